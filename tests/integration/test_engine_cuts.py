"""The reference engine's cuts: a call cut at any token and resumed on a fresh engine makes
exactly the tokens (and logprobs, and MoE routes) of the uninterrupted call.

Real torch on CPU, in process: no server is needed to prove the engine; the HTTP and Ray
wrappers have their own tests.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest

from rollsafe.dataplane.memory import MemoryDataPlane
from rollsafe.engine.model import ModelConfig
from rollsafe.engine.protocol import (
    Completion,
    CutReport,
    GenerateRequest,
    PrefixRecord,
    SamplingParams,
    StreamEvent,
    TokenEvent,
    completion_of,
)
from rollsafe.engine.staging import cut_and_stage, load_prefixes, stage_prefixes
from rollsafe.engine.torch_engine import TorchEngine
from rollsafe.errors import EngineUnavailable, InvalidInput, PrefixMismatch

SEED = 11


def requests(
    n: int, *, seed: int = 0, max_tokens: tuple[int, int] = (6, 40)
) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [
        GenerateRequest(
            call_id=f"call-{i}",
            prompt_tokens=tuple(rng.randrange(1, 512) for _ in range(rng.randint(2, 40))),
            sampling=SamplingParams(
                seed=1000 + i,
                temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
                top_p=rng.choice([1.0, 0.9, 0.5]),
                max_tokens=rng.randint(*max_tokens),
                stop_token_ids=(0, 1),
            ),
        )
        for i in range(n)
    ]


async def run_through(engine: TorchEngine, batch: Sequence[GenerateRequest]) -> list[Completion]:
    async def one(request: GenerateRequest) -> Completion:
        return completion_of(request.call_id, [e async for e in engine.generate(request)])

    return list(await asyncio.gather(*(one(r) for r in batch)))


async def resume_all(
    engine: TorchEngine, batch: Sequence[GenerateRequest], prefixes: dict[str, PrefixRecord]
) -> dict[str, Completion]:
    async def one(request: GenerateRequest) -> Completion:
        prefix = prefixes[request.call_id]
        events = [e async for e in engine.resume(request, prefix)]
        return completion_of(request.call_id, events, prefix)

    todo = [r for r in batch if r.call_id in prefixes]
    done = await asyncio.gather(*(one(r) for r in todo))
    return {c.call_id: c for c in done}


async def cut_at_random_counts(
    engine: TorchEngine, batch: Sequence[GenerateRequest], rng: random.Random
) -> tuple[CutReport, dict[str, int]]:
    """Start every call; cut each once it has made its own random number of tokens (the
    target). The engine is closed afterwards. A call whose target is its last token has
    may have finished by then: its cut is refused as ``finished``."""
    targets = {r.call_id: rng.randint(1, r.sampling.max_tokens) for r in batch}
    reports: list[CutReport] = []

    async def watch(request: GenerateRequest) -> None:
        async for event in engine.generate(request):
            if isinstance(event, TokenEvent) and event.index + 1 == targets[request.call_id]:
                reports.append(await engine.cut([request.call_id]))
                break  # the frozen call's stream is abandoned, as a crashing run would

    await asyncio.gather(*(watch(r) for r in batch))
    await engine.close()
    prefixes = tuple(p for report in reports for p in report.prefixes)
    refused = tuple(x for report in reports for x in report.refused)
    report = CutReport(
        prefixes=prefixes, refused=refused, handoffs=sum(r.handoffs for r in reports)
    )
    return report, targets


@pytest.mark.parametrize("kind", ["dense", "moe"])
async def test_64_calls_cut_at_random_counts_resume_bitwise_on_a_fresh_engine(kind: str) -> None:
    config = ModelConfig(kind=kind)
    batch = requests(64, seed=3)
    async with TorchEngine(config, SEED) as engine:
        uninterrupted = {c.call_id: c for c in await run_through(engine, batch)}

    report, targets = await cut_at_random_counts(TorchEngine(config, SEED), batch, random.Random(5))
    assert len(report.prefixes) >= 40, (
        "most calls must be cut mid-generation for the test to mean much"
    )
    # The engine goes on between a token and the cut that follows it: frozen at the target or
    # a little later, or finished (refused as finished) when the target was near the end.
    for refusal in report.refused:
        assert refusal.reason == "finished"
    assert all(len(p.tokens) >= targets[p.call_id] for p in report.prefixes)
    # Staged and read back through the data plane, as a checkpoint does; the engine is gone.
    dataplane = MemoryDataPlane()
    stage_prefixes(dataplane, report.prefixes)
    staged = load_prefixes(dataplane, [p.call_id for p in report.prefixes])

    async with TorchEngine(config, SEED) as fresh:
        resumed = await resume_all(fresh, batch, staged)
    for call_id, completion in resumed.items():
        expected = uninterrupted[call_id]
        prefix = staged[call_id]
        assert completion.tokens == expected.tokens, call_id
        assert completion.logprobs == expected.logprobs, call_id  # bitwise: float equality
        assert completion.finish_reason == expected.finish_reason
        if kind == "moe":
            assert expected.routes is not None and prefix.routes is not None
            assert prefix.routes == expected.routes[: len(prefix.tokens)]
            assert completion.routes == expected.routes
        else:
            assert completion.routes is None


async def test_resume_twice_gives_the_uninterrupted_result() -> None:
    config = ModelConfig(kind="moe")
    batch = requests(12, seed=8, max_tokens=(20, 40))
    async with TorchEngine(config, SEED) as engine:
        uninterrupted = {c.call_id: c for c in await run_through(engine, batch)}

    rng = random.Random(2)
    first, _ = await cut_at_random_counts(TorchEngine(config, SEED), batch, rng)
    prefixes = {p.call_id: p for p in first.prefixes}
    # Second life: resume, and cut again a few tokens later.
    second_engine = TorchEngine(config, SEED)
    second: dict[str, PrefixRecord] = {}

    async def resume_and_cut(request: GenerateRequest) -> None:
        prefix = prefixes[request.call_id]
        extra = rng.randint(1, 5)
        async for event in second_engine.resume(request, prefix):
            if isinstance(event, TokenEvent) and event.index + 1 == len(prefix.tokens) + extra:
                report = await second_engine.cut([request.call_id])
                second.update({p.call_id: p for p in report.prefixes})
                return
        second[request.call_id] = prefix  # finished before the second cut: resume from the first

    await asyncio.gather(*(resume_and_cut(r) for r in batch if r.call_id in prefixes))
    await second_engine.close()
    assert any(len(second[c].tokens) > len(prefixes[c].tokens) for c in second)

    async with TorchEngine(config, SEED) as third:
        resumed = await resume_all(third, batch, second)
    assert resumed
    for call_id, completion in resumed.items():
        assert completion == uninterrupted[call_id]


async def test_a_frozen_call_released_in_place_finishes_like_the_uninterrupted_one() -> None:
    batch = requests(8, seed=4, max_tokens=(20, 30))
    async with TorchEngine(ModelConfig(), SEED) as engine:
        uninterrupted = {c.call_id: c for c in await run_through(engine, batch)}

    async with TorchEngine(ModelConfig(), SEED) as engine:

        async def one(request: GenerateRequest) -> Completion:
            events: list[StreamEvent] = []
            async for event in engine.generate(request):
                events.append(event)
                if isinstance(event, TokenEvent) and event.index == 3:
                    report = await engine.cut([request.call_id])
                    assert len(report.prefixes) == 1
                    assert (await engine.info()).frozen >= 1
                    assert await engine.release([request.call_id]) == 1
            return completion_of(request.call_id, events)

        released = await asyncio.gather(*(one(r) for r in batch))
    for completion in released:
        assert completion == uninterrupted[completion.call_id]


async def test_a_cut_says_at_once_what_became_of_calls_not_in_flight() -> None:
    """Finished, abandoned, or not admitted yet: one cut answers for each, and a call it named
    before it arrived runs as if it had never been named."""
    done, walked_away, late = requests(3, seed=8, max_tokens=(20, 30))
    async with TorchEngine(ModelConfig(), SEED) as engine:
        (uninterrupted,) = await run_through(engine, [late])
    async with TorchEngine(ModelConfig(), SEED) as engine:
        await run_through(engine, [done])
        stream = engine.generate(walked_away)
        await anext(stream)
        await stream.aclose()  # queues the abandon before the cut below
        report = await engine.cut([done.call_id, walked_away.call_id, late.call_id])
        assert {r.call_id: r.reason for r in report.refused} == {
            done.call_id: "finished",
            walked_away.call_id: "abandoned",
            late.call_id: "not_admitted",
        }
        (arrived,) = await run_through(engine, [late])
    assert arrived == uninterrupted


async def test_cut_of_430_calls_takes_seven_route_handoffs() -> None:
    config = ModelConfig(kind="moe")
    # No stop tokens and a long budget: every call is still in flight when the cut comes.
    batch = [
        r.model_copy(update={"sampling": r.sampling.model_copy(update={"stop_token_ids": ()})})
        for r in requests(430, seed=1, max_tokens=(400, 400))
    ]
    async with TorchEngine(config, SEED) as engine:
        first_token: dict[str, asyncio.Event] = {r.call_id: asyncio.Event() for r in batch}
        frozen = asyncio.Event()

        async def hold(request: GenerateRequest) -> None:
            async for _ in engine.generate(request):
                first_token[request.call_id].set()
                await frozen.wait()  # stop reading; the call is cut and the engine closed
                return

        holders = [asyncio.create_task(hold(r)) for r in batch]
        await asyncio.gather(*(e.wait() for e in first_token.values()))
        before = (await engine.info()).handoffs
        report = await engine.cut([r.call_id for r in batch])
        after = (await engine.info()).handoffs
        frozen.set()
        await asyncio.gather(*holders)
    assert report.handoffs == 7 == after - before - 1  # minus the info() call itself
    assert len(report.prefixes) == 430 and not report.refused
    assert all(p.routes is not None and len(p.routes) == len(p.tokens) for p in report.prefixes)


async def test_refused_cuts_are_reported_per_call_and_do_not_fail_the_others() -> None:
    rng = random.Random(9)
    long_prompt = tuple(rng.randrange(2, 512) for _ in range(300))
    ordinary, constrained, waiting = (
        GenerateRequest(
            call_id=name,
            prompt_tokens=prompt,
            sampling=SamplingParams(seed=i, max_tokens=40, allowed_token_ids=allowed),
        )
        for i, (name, prompt, allowed) in enumerate(
            [
                ("ordinary", (5, 6, 7), None),
                ("constrained", (5, 6, 7), (2, 3, 4)),
                ("waiting", long_prompt, None),
            ]
        )
    )
    async with TorchEngine(ModelConfig(), SEED) as engine:
        streams = {r.call_id: engine.generate(r) for r in (ordinary, constrained)}
        for stream in streams.values():
            await anext(stream)  # both have made a token
        waiting_stream = engine.generate(waiting)
        # Admitted and cut back to back: a 300-token prompt needs ten rounds before its first
        # token, and the cut is queued within the same event-loop turn as the admission.
        _, report = await asyncio.gather(
            anext(waiting_stream),
            engine.cut(["ordinary", "constrained", "waiting", "never-started"]),
        )
        for stream in (*streams.values(), waiting_stream):
            await stream.aclose()
    reasons = {r.call_id: r.reason for r in report.refused}
    assert reasons == {
        "constrained": "constrained_decoding",
        "waiting": "no_tokens",
        "never-started": "not_admitted",
    }
    assert [p.call_id for p in report.prefixes] == ["ordinary"]


async def test_resume_refuses_a_prefix_that_does_not_match_and_leaves_the_engine_usable() -> None:
    request = requests(1, seed=6, max_tokens=(30, 30))[0]
    engine = TorchEngine(ModelConfig(kind="moe"), SEED)
    stream = engine.generate(request)
    for _ in range(5):
        await anext(stream)
    prefix = (await engine.cut([request.call_id])).prefixes[0]
    await stream.aclose()
    await engine.close()

    other_prompt = request.model_copy(update={"prompt_tokens": (*request.prompt_tokens, 9)})
    other_seed = request.model_copy(
        update={"sampling": request.sampling.model_copy(update={"seed": 1})}
    )
    cases = {
        "digest": (request, prefix.model_copy(update={"tokens": (*prefix.tokens[:-1], 3)})),
        "prompt_digest": (other_prompt, prefix),
        "sampling": (other_seed, prefix),
        "call_id": (request.model_copy(update={"call_id": "someone-else"}), prefix),
    }
    async with TorchEngine(ModelConfig(kind="moe"), SEED) as fresh:
        for field, (asked, given) in cases.items():
            with pytest.raises(PrefixMismatch) as caught:
                async for _ in fresh.resume(asked, given):
                    pass
            assert caught.value.field == field
        async with TorchEngine(ModelConfig(kind="dense"), SEED) as dense:
            with pytest.raises(PrefixMismatch, match="model"):
                async for _ in dense.resume(request, prefix):
                    pass
        # Nothing was admitted by the refusals: the genuine prefix still resumes.
        tokens = [e async for e in fresh.resume(request, prefix)]
        assert tokens and (await fresh.info()).active == 0


async def test_duplicate_call_and_bad_prompt_are_refused_by_name() -> None:
    request = requests(1, seed=2, max_tokens=(40, 40))[0]
    async with TorchEngine(ModelConfig(), SEED) as engine:
        first = engine.generate(request)
        await anext(first)
        with pytest.raises(InvalidInput, match="already in flight"):
            await anext(engine.generate(request))
        await first.aclose()
        bad = request.model_copy(update={"call_id": "bad", "prompt_tokens": (1, 99_999)})
        with pytest.raises(InvalidInput, match="99999"):
            await anext(engine.generate(bad))


async def test_cut_and_stage_stages_what_was_cut_and_reports_the_rest() -> None:
    batch = requests(5, seed=12, max_tokens=(40, 40))
    dataplane = MemoryDataPlane()
    async with TorchEngine(ModelConfig(kind="moe"), SEED) as engine:
        streams = [engine.generate(r) for r in batch]
        for stream in streams:
            await anext(stream)
        staged = await cut_and_stage(engine, [r.call_id for r in batch] + ["gone"], dataplane)
        for stream in streams:
            await stream.aclose()
    assert set(staged.staged) == {r.call_id for r in batch}
    assert [x.call_id for x in staged.refused] == ["gone"]
    loaded = load_prefixes(dataplane, staged.staged)
    assert {c: len(p.tokens) for c, p in loaded.items()} == staged.staged


async def test_a_resume_supersedes_the_same_call_still_frozen_on_a_live_engine() -> None:
    """The run crashed after a snapshot, the engine did not: the call is still frozen there."""
    request = requests(1, seed=14, max_tokens=(30, 30))[0]
    async with TorchEngine(ModelConfig(), SEED) as engine:
        uninterrupted = await run_through(engine, [request])
    async with TorchEngine(ModelConfig(), SEED) as engine:
        old_stream = engine.generate(request)
        for _ in range(4):
            await anext(old_stream)
        prefix = (await engine.cut([request.call_id])).prefixes[0]
        with pytest.raises(InvalidInput, match="already in flight"):  # generate never replaces
            await anext(engine.generate(request))
        resumed = engine.resume(request, prefix)
        events = [await anext(resumed)]
        # The superseded reader ends (and walks away) while the resumed call runs: that must
        # not take the resumed call with it.
        with pytest.raises(EngineUnavailable, match="superseded by a resume"):
            async for _ in old_stream:
                pass
        async with asyncio.timeout(30):  # a resumed call taken away never finishes
            events += [e async for e in resumed]
        assert [completion_of(request.call_id, events, prefix)] == uninterrupted
