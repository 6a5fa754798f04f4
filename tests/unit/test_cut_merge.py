"""The cut phase merges every engine's answer in one pass, and goes on without an engine that
cannot answer (rollsafe.checkpoint.phases.cut_generation)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from rollsafe.checkpoint.participants import ParticipantOptions, Participants
from rollsafe.checkpoint.phases.cut_generation import cut_calls, merge_cuts
from rollsafe.checkpoint.phases.resume import resume_participants
from rollsafe.dataplane import make_dataplane
from rollsafe.engine.protocol import (
    CutRefusal,
    CutReport,
    PrefixRecord,
    SamplingParams,
    prompt_digest,
    seal_prefix,
)
from rollsafe.engine.staging import StagedCut, load_prefixes
from rollsafe.env.fleet_rules import FleetPrepared, InstanceInventory
from rollsafe.env.protocol import EpisodeRef, ParkedEpisode
from rollsafe.errors import EngineUnavailable
from rollsafe.loop_thread import LoopThread


def cut(staged: dict[str, int], **reasons: str) -> StagedCut:
    refused = tuple(CutRefusal(call_id=c, reason=r) for c, r in reasons.items())
    return StagedCut(staged=staged, refused=refused, handoffs=1)


def test_the_engine_that_held_a_call_is_believed_over_those_that_did_not() -> None:
    a = cut({"x": 4}, y="finished", z="not_admitted", w="not_admitted", v="no_tokens")
    b = cut(
        {}, x="not_admitted", y="not_admitted", z="not_admitted", w="abandoned", v="unknown_call"
    )
    merged = merge_cuts(["x", "y", "z", "w", "v"], [a, b])
    assert merged.staged == {"x": 4}
    assert {r.call_id: r.reason for r in merged.refused} == {
        "y": "finished",
        "z": "not_admitted",
        "w": "abandoned",
        "v": "no_tokens",
    }
    assert [r.call_id for r in merged.refused] == ["y", "z", "w", "v"]  # in the calls' order
    assert merged.handoffs == 2


def test_no_engine_leaves_every_call_unknown() -> None:
    merged = merge_cuts(["x"], [])
    assert [(r.call_id, r.reason) for r in merged.refused] == [("x", "unknown_call")]


def test_an_engine_that_did_not_answer_outweighs_one_that_never_saw_the_call() -> None:
    a = cut({}, x="not_admitted", y="finished")
    b = cut({}, x="engine_unavailable", y="engine_unavailable")
    for order in ([a, b], [b, a]):
        merged = merge_cuts(["x", "y"], order)
        assert {r.call_id: r.reason for r in merged.refused} == {
            "x": "engine_unavailable",  # the silent engine may have held it
            "y": "finished",  # the engine that held it knows best
        }


# -- engines that die or hang during the cut or the resume (issue 22, parts 3 and 5) ----------


class FakeEngine:
    """The cut/release half of the Engine protocol: holds call ``a`` and cuts it, refusing the
    others as not admitted. ``Dead`` fails as an unreachable engine does; ``Hung`` accepts
    and never answers (until the test ends)."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def cut(self, call_ids: Sequence[str], **_: object) -> CutReport:
        refused = tuple(CutRefusal(call_id=c, reason="not_admitted") for c in call_ids if c != "a")
        return CutReport(prefixes=(prefix("a"),), refused=refused, handoffs=1)

    async def release(self, call_ids: Sequence[str]) -> int:
        self.released = list(call_ids)
        return len(call_ids)


class Dead(FakeEngine):
    async def cut(self, call_ids: Sequence[str], **_: object) -> CutReport:
        raise EngineUnavailable("engine at http://dead unreachable: ConnectError")

    async def release(self, call_ids: Sequence[str]) -> int:
        raise EngineUnavailable("engine at http://dead unreachable: ConnectError")


class Hung(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.let_go = asyncio.Event()

    async def cut(self, call_ids: Sequence[str], **_: object) -> CutReport:
        await self.let_go.wait()
        raise AssertionError("the hung engine was waited for past its deadline")

    async def release(self, call_ids: Sequence[str]) -> int:
        await self.let_go.wait()
        raise AssertionError("the hung engine was waited for past its deadline")


class Fleet:
    names = ("w0",)

    def __init__(self) -> None:
        self.resumed: list[str] = []

    async def resume_all(self, checkpoint_id: str) -> None:
        self.resumed.append(checkpoint_id)


def prefix(call_id: str) -> PrefixRecord:
    sampling = SamplingParams(seed=1, max_tokens=8)
    return seal_prefix(
        call_id=call_id, model="0" * 64, prompt_digest=prompt_digest([1, 2]), sampling=sampling,
        tokens=(5, 6), logprobs=(-0.1, -0.2), weight_versions=(0, 0),
    )  # fmt: skip


def generating(*calls: str) -> FleetPrepared:
    parked = tuple(
        ParkedEpisode(
            episode=EpisodeRef(rollout_id=f"run-{n}_g0", attempt=0),
            turn=1,
            activity="generating",
            model_call_id=call,
        )
        for n, call in enumerate(calls)
    )
    inventory = InstanceInventory(parked=parked, restarts=(), lease_expires_ts=time.time() + 30)
    return FleetPrepared(
        checkpoint_id="c1", deadline_ts=time.time() + 30, instances={"w0": inventory}
    )


def test_a_dead_and_a_hung_engine_degrade_their_calls_to_turn_level_and_do_not_hold_resume() -> (
    None
):
    """The cut goes on without the engines that cannot answer (within the deadline: the hung
    one is never answered), their calls refused as ``engine_unavailable``, named; the staged
    prefix of the healthy engine is kept; resume releases the staged and the unanswered calls
    on every engine and names the two it could not, without failing (the snapshot still
    publishes)."""
    healthy, hung, fleet, loop = FakeEngine(), Hung(), Fleet(), LoopThread("test-cut")
    engines = {"e0": healthy, "e1": Dead(), "e2": hung}
    options = ParticipantOptions(engine_deadline_s=0.2)
    participants = Participants(fleet, engines, loop=loop, options=options)  # type: ignore[arg-type]
    dataplane = make_dataplane("memory")
    try:
        staged = cut_calls(participants, generating("a", "b"), dataplane)
        assert staged.staged == {"a": 2}
        [refusal] = staged.refused
        assert refusal.call_id == "b" and refusal.reason == "engine_unavailable"
        assert "engine e" in refusal.detail
        assert load_prefixes(dataplane, ["a"])["a"].tokens == (5, 6)
        summary = resume_participants(participants, "c1", staged)
    finally:
        loop.run(_set(hung.let_go))
        loop.close()
    # b too: an engine that did not answer may have frozen it after all.
    assert fleet.resumed == ["c1"] and healthy.released == ["a", "b"]
    assert "engine e1 did not release" in summary and "unreachable" in summary
    assert "engine e2 did not release" in summary and "no answer within 0.2 s" in summary


async def _set(event: asyncio.Event) -> None:
    event.set()
