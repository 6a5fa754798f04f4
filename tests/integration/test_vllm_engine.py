"""The engine protocol on real vLLM (its CPU build), in process: calls cut at random points
resume with exactly the tokens, logprobs, finish reasons and MoE routes of the uninterrupted
calls, alone or batched, dense and MoE, in float32. One engine per (model, dtype), shared by
the module's tests (vLLM allows one in-process engine at a time); the models are tiny and built
here (tests/conftest.py: ``tiny_models``).

bfloat16 is served and cut like float32, but vLLM's CPU bf16 matmuls are not batch-invariant
(measured here on vLLM alone: the same greedy tokens, logprobs up to 0.03 apart between a call
alone and in a batch of six), so its tests check what holds by construction: the prefix is
kept exactly and the call resumes from it. docs/generation-cuts.md, "vLLM".

The HTTP server, a SIGKILLed server and a fresh process: tests/integration/test_vllm_http.py.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from rollsafe.engine.loop import HoldRule
from rollsafe.engine.protocol import (
    Completion,
    GenerateRequest,
    PrefixRecord,
    SamplingParams,
    StreamEvent,
    completion_of,
    seal_prefix,
)
from rollsafe.engine.vllm.engine import VllmEngine
from rollsafe.errors import InvalidInput, PrefixMismatch
from rollsafe.testing.parity import completed, mismatches
from rollsafe.testing.waiting import eventually_async

VOCAB = 1024
EXACT = [("dense", "float32"), ("moe", "float32")]
BF16 = [("moe", "bfloat16")]
LIMIT_S = 120


def on(*combos: tuple[str, str]) -> pytest.MarkDecorator:
    """Run the test on the engines of these (arch, dtype) combinations."""
    ids = [f"{arch}-{dtype}" for arch, dtype in combos]
    return pytest.mark.parametrize("engine", combos, ids=ids, indirect=True)


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> Iterator[VllmEngine]:
    """One engine per combination, kept for the module's tests of it (pytest groups them, and
    ends one engine before it starts the next)."""
    arch, dtype = request.param
    engine = VllmEngine(tiny_models[arch], dtype=dtype, max_model_len=256)
    try:
        yield engine
    finally:
        asyncio.run(engine.close())


def requests(n: int, *, seed: int, tag: str = "c") -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [
        GenerateRequest(
            call_id=f"{tag}-{i}",
            prompt_tokens=tuple(rng.randrange(VOCAB) for _ in range(rng.randint(2, 40))),
            sampling=SamplingParams(
                seed=1000 + i,
                temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
                top_p=rng.choice([1.0, 0.9, 0.5]),
                max_tokens=rng.randint(24, 64),
                stop_token_ids=(0, 1),
            ),
        )
        for i in range(n)
    ]


async def alone(engine: VllmEngine, batch: Sequence[GenerateRequest]) -> list[Completion]:
    return [await completed(engine, r) for r in batch]


async def cut_each_after(
    engine: VllmEngine, request: GenerateRequest, count: int
) -> Completion | PrefixRecord:
    """Read ``count`` tokens, then cut this call alone (the engine may have made a few more):
    its prefix record, or its completion if it finished first."""
    stream: AsyncIterator[StreamEvent] = engine.generate(request)
    events = []
    async for event in stream:
        events.append(event)
        if len(events) >= count:
            break
    report = await engine.cut([request.call_id])
    await stream.aclose()  # type: ignore[attr-defined]
    if report.prefixes:
        (prefix,) = report.prefixes
        return PrefixRecord.model_validate_json(prefix.model_dump_json())  # as staged
    assert [r.reason for r in report.refused] == ["finished"], report.refused
    return completion_of(request.call_id, [e async for e in engine.generate(request)])


@on(*EXACT)
async def test_calls_cut_at_random_points_resume_exactly(engine: VllmEngine) -> None:
    async with asyncio.timeout(LIMIT_S):
        batch = requests(16, seed=1)
        reference = await alone(engine, batch)
        batched = await asyncio.gather(*(completed(engine, r) for r in batch))
        assert mismatches(reference, batched) == []  # batching changes nothing
        rng = random.Random(2)
        cuts = await asyncio.gather(*(cut_each_after(engine, r, rng.randint(1, 20)) for r in batch))
        prefixes = {p.call_id: p for p in cuts if isinstance(p, PrefixRecord)}
        assert len(prefixes) >= len(batch) // 2, "most calls are cut mid-way"
        got = await asyncio.gather(
            *(completed(engine, r, prefixes[r.call_id]) for r in batch if r.call_id in prefixes)
        )
        want = [c for c in reference if c.call_id in prefixes]
        assert mismatches(want, list(got)) == []
        info = await engine.info()
        assert (info.active, info.frozen) == (0, 0)
        if engine.kind == "moe":
            assert all(c.routes is not None and len(c.routes) == len(c.tokens) for c in got)


@on(*EXACT)
async def test_a_held_call_waits_outside_vllm_until_a_cut_and_resumes_exactly(
    engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hold instrument (``ROLLSAFE_ENGINE_HOLD``) on vLLM: a held call leaves vLLM's
    scheduler after ``after_tokens`` tokens and makes nothing more; the cut freezes it there,
    ends the hold (``once``), and the released call ends exactly like an uninterrupted one."""
    async with asyncio.timeout(LIMIT_S):
        held, free = requests(2, seed=11, tag="hold")
        reference = await alone(engine, [held, free])
        # The module's engine, not one built with the variable set: vLLM allows one engine
        # per process and builds one in tens of seconds. The rule is what the variable carries.
        monkeypatch.setattr(engine, "_hold", HoldRule(calls="^hold-0$", after_tokens=3))
        stream = engine.generate(held)
        reading = asyncio.ensure_future(completion_of_stream(held, stream))
        await eventually_async(lambda: held_calls(engine), what="the call held")
        # Other calls run past a held one.
        assert mismatches([reference[1]], [await completed(engine, free)]) == []
        report = await engine.cut([held.call_id])
        assert [len(p.tokens) for p in report.prefixes] == [3]  # nothing made while held
        info = await engine.info()
        assert (info.held, info.frozen) == (0, 1)
        assert await engine.release([held.call_id]) == 1
        assert mismatches([reference[0]], [await reading]) == []
        assert engine._hold is None  # the first cut ended it for every call


async def held_calls(engine: VllmEngine) -> int:
    return (await engine.info()).held


async def completion_of_stream(
    request: GenerateRequest, stream: AsyncIterator[StreamEvent]
) -> Completion:
    return completion_of(request.call_id, [event async for event in stream])


@on(*BF16)
async def test_bf16_cuts_keep_the_prefix_and_resume_from_it(engine: VllmEngine) -> None:
    """bfloat16 is not batch-invariant here (module docstring): what holds by construction."""
    async with asyncio.timeout(LIMIT_S):
        batch = requests(8, seed=6, tag="bf16")
        rng = random.Random(7)
        cuts = await asyncio.gather(*(cut_each_after(engine, r, rng.randint(1, 20)) for r in batch))
        prefixes = {p.call_id: p for p in cuts if isinstance(p, PrefixRecord)}
        assert prefixes
        for request in batch:
            if (prefix := prefixes.get(request.call_id)) is not None:
                resumed = await completed(engine, request, prefix)
                n = len(prefix.tokens)
                assert resumed.tokens[:n] == prefix.tokens
                assert resumed.routes is not None and resumed.routes[:n] == prefix.routes
                assert len(resumed.tokens) == request.sampling.max_tokens or (
                    resumed.finish_reason == "stop" and resumed.tokens[-1] in (0, 1)
                )


@on(*EXACT)
async def test_a_prefix_shifted_by_one_token_is_caught(engine: VllmEngine) -> None:
    """The parity check is not blind: resuming from a prefix one token short (re-sealed, so
    the record itself verifies) makes a different call, and the check says where."""
    async with asyncio.timeout(LIMIT_S):
        (request,) = requests(1, seed=3, tag="shift")
        request = request.model_copy(
            update={"sampling": request.sampling.model_copy(update={"temperature": 1.0})}
        )
        reference = await completed(engine, request)
        cut = await cut_each_after(engine, request, 6)
        assert isinstance(cut, PrefixRecord)
        fields = cut.model_dump(exclude={"digest"})
        for name in ("tokens", "logprobs", "weight_versions", "routes"):
            if fields[name] is not None:
                fields[name] = fields[name][1:]
        shifted = seal_prefix(**fields)
        broken = await completed(engine, request, shifted)
        assert mismatches([reference], [broken]) != []


@on(*EXACT, *BF16)
async def test_refusals_name_their_reason_and_leave_the_engine_serving(
    engine: VllmEngine,
) -> None:
    async with asyncio.timeout(LIMIT_S):
        (request,) = requests(1, seed=4, tag="bad")
        constrained = request.model_copy(
            update={
                "call_id": "constrained",
                "sampling": request.sampling.model_copy(
                    update={"allowed_token_ids": (5, 6, 7), "max_tokens": 200}
                ),
            }
        )
        stream = engine.generate(constrained)
        first = await anext(stream)
        assert first.token in (5, 6, 7)  # type: ignore[union-attr]
        report = await engine.cut(["constrained", "never-started"])
        assert {r.call_id: r.reason for r in report.refused} == {
            "constrained": "constrained_decoding",
            "never-started": "not_admitted",
        }
        await stream.aclose()
        for tokens, problem in (((3, VOCAB), "outside"), ((-1,), "outside")):
            with pytest.raises(InvalidInput, match=problem):
                await completed(engine, request.model_copy(update={"prompt_tokens": tokens}))
        too_long = request.model_copy(
            update={"sampling": request.sampling.model_copy(update={"max_tokens": 300})}
        )
        with pytest.raises(InvalidInput, match="exceeds the model's 256"):
            await completed(engine, too_long)
        cut = await cut_each_after(engine, request, 3)
        assert isinstance(cut, PrefixRecord)
        foreign = seal_prefix(**{**cut.model_dump(exclude={"digest"}), "model": "0" * 64})
        with pytest.raises(PrefixMismatch, match="model"):
            await completed(engine, request, foreign)
        assert (
            mismatches([await completed(engine, request)], [await completed(engine, request, cut)])
            == []
        )


@on(*EXACT)
async def test_new_weights_show_in_versions_and_bad_ones_are_refused(
    engine: VllmEngine, tiny_models: dict[str, Path]
) -> None:
    """Cut, update the weights, resume: the tokens after the update carry the new version and
    come from the new weights. (That they are the weights a model saved with them serves:
    test_vllm_http.py, in a fresh process.) Last in the module: it changes the engine."""
    arch = engine.kind
    async with asyncio.timeout(LIMIT_S):
        (request,) = requests(1, seed=5, tag="weights")
        before = await completed(engine, request)
        cut = await cut_each_after(engine, request, 4)
        assert isinstance(cut, PrefixRecord)
        weights = perturbed(tiny_models[arch])
        version = (await engine.info()).weight_version + 1
        await engine.update_weights(weights, version)
        after = await completed(engine, request, cut)
        n = len(cut.tokens)
        assert after.weight_versions == (version - 1,) * n + (version,) * (len(after.tokens) - n)
        assert after.logprobs[n:] != before.logprobs[n:]  # the new weights really serve
        name = next(iter(weights))
        for bad, problem in (
            ({name: weights[name]}, "not newer"),
            ({"no.such.weight": torch.zeros(1)}, "not in"),
            ({name: torch.zeros(3)}, "shape"),
        ):
            with pytest.raises(InvalidInput, match=problem):
                await engine.update_weights(bad, version + (problem != "not newer"))
        assert (await engine.info()).weight_version == version


def perturbed(model_dir: Path) -> dict[str, torch.Tensor]:
    """The model's checkpoint with noise added: new weights, same names and shapes."""
    from safetensors.torch import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(9)
    return {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in weights.items()
    }
