"""Effects applied once per (rollout, turn, name): the pure ledger, then the toolkit with an
environment whose every turn submits to a "world" that keeps duplicates. Episodes are held
where the test needs them (at a boundary, inside an effect) by events, never by time."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollsafe.env.effects import EffectKey, EffectLedger, args_sha256
from rollsafe.env.hooks import EnvironmentHooks, EpisodeSession
from rollsafe.env.participant import Participant
from rollsafe.env.protocol import (
    AppliedEffect,
    CommitRequest,
    EffectsRequest,
    EpisodeRef,
    EpisodeResult,
    PrepareRequest,
    RestoreRequest,
    ResumeRequest,
    RunEpisode,
    RunLease,
)
from rollsafe.errors import EffectDiverged, InvalidInput, ParticipantRefused, SnapshotCorrupt
from rollsafe.testing.waiting import eventually_async

EP = EpisodeRef(rollout_id="fx-1_g0", attempt=0)
TURNS = 3
SHA = args_sha256([1])


# -- the ledger, pure -------------------------------------------------------------------------


def test_a_key_is_recorded_once_and_answered_with_its_result() -> None:
    ledger, key = EffectLedger(), EffectKey("r_g0", 2, "submit")
    assert ledger.lookup(key, SHA) is None
    ledger.record(key, SHA, {"receipt": 7}, attempt=0, applied_ts=1.0)
    done = ledger.lookup(key, SHA)
    assert done is not None and (done.result, done.attempt) == ({"receipt": 7}, 0)
    assert key.id == "r_g0/t2/submit"
    with pytest.raises(EffectDiverged, match=r"effect r_g0/t2/submit: applied by attempt 0"):
        ledger.lookup(key, args_sha256([2]))


def test_the_attempt_last_run_or_restored_is_current_and_fences_the_others() -> None:
    ledger = EffectLedger()
    ledger.fence(EP)  # nothing known: nothing fenced
    ledger.make_current(EP.next_attempt())
    with pytest.raises(ParticipantRefused, match="superseded") as info:
        ledger.fence(EP)
    assert info.value.reason == "superseded"
    ledger.fence(EP.next_attempt())
    # A restore from an older snapshot numbers attempts from it again: the last one counts.
    ledger.make_current(EP)
    ledger.fence(EP)
    with pytest.raises(ParticipantRefused):
        ledger.fence(EP.next_attempt())


def test_install_keeps_what_the_instance_already_applied() -> None:
    ledger, key = EffectLedger(), EffectKey("r_g0", 0, "submit")
    ledger.record(key, SHA, "mine", attempt=1, applied_ts=1.0)
    theirs = AppliedEffect(
        turn=0, name="submit", args_sha256=SHA, result="theirs", attempt=0, applied_ts=1.0
    )
    other = theirs.model_copy(update={"turn": 1})
    ledger.install("r_g0", (theirs, other))
    assert [(e.turn, e.result) for e in ledger.of_rollout("r_g0")] == [(0, "mine"), (1, "theirs")]


def test_the_least_recently_touched_rollouts_are_forgotten_beyond_the_bound() -> None:
    ledger = EffectLedger(max_rollouts=2)
    for rollout in ("a_g0", "b_g0", "c_g0"):
        ledger.record(EffectKey(rollout, 0, "x"), SHA, None, attempt=0, applied_ts=1.0)
    assert ledger.of_rollout("a_g0") == () and len(ledger.of_rollout("c_g0")) == 1


async def test_a_second_attempt_waits_for_the_first_on_the_same_key() -> None:
    ledger, key, order = EffectLedger(), EffectKey("r_g0", 0, "x"), []
    first_in, go = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with ledger.held(key):
            first_in.set()
            await go.wait()
            order.append("first")

    async def second() -> None:
        async with ledger.held(key):
            order.append("second")

    a = asyncio.ensure_future(hold())
    await first_in.wait()
    b, c = asyncio.ensure_future(second()), asyncio.ensure_future(second())
    go.set()
    await asyncio.gather(a, b, c)
    assert order == ["first", "second", "second"] and not ledger._locks


def test_a_bad_effect_name_or_turn_is_refused_before_anything_is_applied() -> None:
    with pytest.raises(InvalidInput, match="effect name 'a b' is not"):
        EffectKey("r_g0", 0, "a b")
    with pytest.raises(InvalidInput, match="turn -1 is negative"):
        EffectKey("r_g0", -1, "x")


def test_args_and_results_must_be_json() -> None:
    with pytest.raises(TypeError, match="must be JSON"):
        args_sha256({1, 2})
    assert args_sha256({"b": 1, "a": 2}) == args_sha256({"a": 2, "b": 1})


# -- the toolkit ------------------------------------------------------------------------------


class Submitter(EnvironmentHooks):
    """Each turn submits ``turn * 10`` to ``world`` (which keeps duplicates) as effect
    ``submit``; an episode can be held inside a turn's effect or at a boundary."""

    name = "submitter"

    def __init__(self) -> None:
        self.world: list[tuple[str, int]] = []  # (key id, value): every application
        self.turn: dict[str, int] = {}
        self.inside: dict[tuple[str, int], asyncio.Event] = {}  # (key, turn) -> entered
        self.gates: dict[tuple[str, int], asyncio.Event] = {}  # (key, turn) -> release
        self.value: Callable[[int], int] = lambda turn: turn * 10

    def hold_effect(self, ep: EpisodeRef, turn: int) -> None:
        self.inside[(ep.key, turn)], self.gates[(ep.key, turn)] = asyncio.Event(), asyncio.Event()

    async def _submit(self, key: EffectKey, ep: EpisodeRef, turn: int, value: int) -> int:
        if (gate := self.gates.get((ep.key, turn))) is not None:
            self.inside[(ep.key, turn)].set()
            await gate.wait()
        self.world.append((key.id, value))
        return len(self.world)

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        ep = session.episode
        turn = self.turn[ep.key] = (session.restored or {"turn": 0})["turn"]
        receipts = []
        while True:
            await session.boundary(turn)
            if turn == run.task.get("turns", TURNS):
                break
            value = self.value(turn)
            apply = lambda key, t=turn, v=value: self._submit(key, ep, t, v)  # noqa: E731
            receipts.append(await session.effect(turn, "submit", apply, args=[value]))
            turn = self.turn[ep.key] = turn + 1
        return EpisodeResult(
            episode=ep, reward=1.0, turns=turn, restored=False, info={"receipts": receipts}
        )

    def export_episode(self, episode: EpisodeRef) -> dict[str, Any]:
        return {"turn": self.turn[episode.key]}

    def state_digest(self, episode: EpisodeRef) -> str | None:
        return hashlib.sha256(str(self.turn[episode.key]).encode()).hexdigest()

    def drop_episode(self, episode: EpisodeRef) -> None:
        self.turn.pop(episode.key, None)


def applied(env: Submitter) -> list[str]:
    return [key for key, _ in env.world]


async def checkpoint_after_first_turn(
    part: Participant, env: Submitter, dest: Path
) -> asyncio.Task[EpisodeResult]:
    """Run EP until parked at boundary 1 and commit it as ck1; resumed, the run goes on."""
    env.hold_effect(EP, 1)
    run = asyncio.ensure_future(part.run(RunEpisode(episode=EP, audit=True)))
    await env.inside[(EP.key, 1)].wait()  # turn 0 applied; held inside turn 1's effect
    request = PrepareRequest(checkpoint_id="ck1", deadline_ts=_soon())
    prepare = asyncio.ensure_future(part.prepare(request))
    await eventually_async(lambda: part.status().phase == "prepared", what="admission closed")
    env.gates[(EP.key, 1)].set()  # turn 1 applied, parked at boundary 2
    assert (await prepare).parked[0].turn == 2
    await part.commit(CommitRequest(checkpoint_id="ck1", scope=(EP,), dest=str(dest)))
    await part.resume(ResumeRequest(checkpoint_id="ck1"))
    return run


def _soon() -> float:
    return time.time() + 5


def restore_request(dest: Path, rid: str = "r1") -> RestoreRequest:
    return RestoreRequest(
        restore_id=rid, source_checkpoint_id="ck1", root=str(dest), scope=(EP,), deadline_ts=_soon()
    )


async def test_a_restored_attempt_gets_the_applied_effects_answered_not_applied(
    tmp_path: Path,
) -> None:
    env = Submitter()
    part = Participant("fx-0", env, tool_wait_s=0.1)
    first = await (await checkpoint_after_first_turn(part, env, tmp_path / "ck1"))
    assert applied(env) == [f"{EP.rollout_id}/t{t}/submit" for t in range(TURNS)]
    assert first.audit is not None and all(e.applied for e in first.audit.effects)
    await part.restore(restore_request(tmp_path / "ck1"))
    await part.resume(ResumeRequest(checkpoint_id="r1"))
    again = await part.run(RunEpisode(episode=EP.next_attempt(), audit=True))
    assert len(env.world) == TURNS  # nothing applied twice
    assert again.info["receipts"] == first.info["receipts"][2:]  # the recorded results
    assert again.audit is not None
    assert [(e.turn, e.applied) for e in again.audit.effects] == [(2, False)]
    assert again.audit.state_digests.keys() == {2, 3}
    assert first.audit.state_digests[3] == again.audit.state_digests[3]


async def test_another_instance_restores_the_effects_the_record_carries(tmp_path: Path) -> None:
    env = Submitter()
    part = Participant("fx-0", env, tool_wait_s=0.1)
    await (await checkpoint_after_first_turn(part, env, tmp_path / "ck1"))
    records = (tmp_path / "ck1" / "submitter").glob("records-*.jsonl")
    (record,) = [json.loads(line) for path in records for line in path.read_text().splitlines()]
    assert [(e["turn"], e["attempt"]) for e in record["effects"]] == [(0, 0), (1, 0)]
    other_env = Submitter()
    other = Participant("fx-1", other_env, tool_wait_s=0.1)
    await other.restore(restore_request(tmp_path / "ck1"))
    await other.resume(ResumeRequest(checkpoint_id="r1"))
    (ledger,) = other.applied_effects(EffectsRequest(rollouts=(EP.rollout_id,))).rollouts
    assert (ledger.current_attempt, len(ledger.applied)) == (1, 2)
    await other.run(RunEpisode(episode=EP.next_attempt()))
    # Turn 2 was applied after the checkpoint on an instance this one never heard of: it is
    # applied here under the same key id, which a downstream that drops repeats recognises.
    assert applied(other_env) == [f"{EP.rollout_id}/t2/submit"]


async def test_an_abandoned_attempt_is_fenced_and_its_effect_not_applied_twice(
    tmp_path: Path,
) -> None:
    env = Submitter()
    part = Participant("fx-0", env, tool_wait_s=0.1)
    env.hold_effect(EP, 2)
    abandoned = await checkpoint_after_first_turn(part, env, tmp_path / "ck1")
    await env.inside[(EP.key, 2)].wait()  # attempt 0, its caller gone, inside turn 2's effect
    await part.restore(restore_request(tmp_path / "ck1"))
    await part.resume(ResumeRequest(checkpoint_id="r1"))
    successor = asyncio.ensure_future(part.run(RunEpisode(episode=EP.next_attempt())))
    env.gates[(EP.key, 2)].set()  # before or after the successor asks: it is answered
    with pytest.raises(ParticipantRefused, match="superseded"):
        await abandoned  # applied turn 2, then fenced at its next boundary
    result = await successor
    assert applied(env) == [f"{EP.rollout_id}/t{t}/submit" for t in range(TURNS)]
    assert result.turns == TURNS and result.info["receipts"] == [3]  # attempt 0's receipt


async def test_an_effect_asked_again_with_other_args_is_refused_not_applied(
    tmp_path: Path,
) -> None:
    env = Submitter()
    part = Participant("fx-0", env, tool_wait_s=0.1)
    await (await checkpoint_after_first_turn(part, env, tmp_path / "ck1"))
    await part.restore(restore_request(tmp_path / "ck1"))
    await part.resume(ResumeRequest(checkpoint_id="r1"))
    env.value = lambda turn: turn * 10 + 1  # not deterministic given the record
    with pytest.raises(EffectDiverged, match=rf"effect {EP.rollout_id}/t2/submit"):
        await part.run(RunEpisode(episode=EP.next_attempt()))
    assert len(env.world) == TURNS


async def test_a_result_that_is_not_json_is_recorded_as_applied_then_refused() -> None:
    env = Submitter()
    part = Participant("fx-0", env, tool_wait_s=0.1)

    async def odd(key: EffectKey, ep: EpisodeRef, turn: int, value: int) -> Any:
        env.world.append((key.id, value))
        return {1, 2}

    env._submit = odd  # type: ignore[method-assign]
    with pytest.raises(TypeError, match="not JSON; recorded as applied"):
        await part.run(RunEpisode(episode=EP))
    (entry,) = part.applied_effects(EffectsRequest(rollouts=(EP.rollout_id,))).rollouts
    assert [(e.turn, e.result) for e in entry.applied] == [(0, None)] and len(env.world) == 1


async def test_records_without_effects_restore_and_bad_effects_are_named(
    tmp_path: Path,
) -> None:
    env = Submitter()
    part = Participant("fx-0", env, tool_wait_s=0.1)
    await (await checkpoint_after_first_turn(part, env, tmp_path / "ck1"))
    (path,) = (tmp_path / "ck1" / "submitter").glob("records-*.jsonl")
    record = json.loads(path.read_text())
    for effects, rid in (([{"turn": 0}], "r-bad"), (None, "r-old")):
        if effects is None:
            record.pop("effects")
        else:
            record["effects"] = effects
        write_records(tmp_path / rid, record)
        fresh = Participant(f"fx-{rid}", Submitter(), tool_wait_s=0.1)
        request = restore_request(tmp_path / rid, rid)
        if effects is not None:
            with pytest.raises(SnapshotCorrupt, match="bad effects"):
                await fresh.restore(request)
        else:
            assert (await fresh.restore(request)).restored == (EP.next_attempt(),)


def write_records(dest: Path, record: dict[str, Any]) -> None:
    from rollsafe.env import store

    store.write_records(dest, "submitter", "environment", "fx-0", "ck1", [record])


def test_an_unaudited_run_and_its_result_serialize_as_before() -> None:
    run = RunEpisode(episode=EP)
    assert "audit" not in run.model_dump(mode="json")
    assert RunEpisode(episode=EP, audit=True).model_dump(mode="json")["audit"] is True
    result = EpisodeResult(episode=EP, reward=0, turns=0, restored=False)
    assert "audit" not in result.model_dump(mode="json")


async def test_an_episode_whose_run_lease_ran_out_is_refused_its_next_effect() -> None:
    now = [1000.0]
    env = Submitter()
    part = Participant("fx-0", env, tool_wait_s=0.1, clock=lambda: now[0])
    lease = RunLease(holder="dispatcher-1", ttl_s=2.0)
    env.hold_effect(EP, 1)
    run = asyncio.ensure_future(part.run(RunEpisode(episode=EP, lease=lease)))
    await env.inside[(EP.key, 1)].wait()  # turn 0 applied under the lease, turn 1 in flight
    assert part.take_lease(lease).expires_ts == 1002.0  # renewed: its dispatcher lives
    now[0] = 1002.0  # not renewed since: it ran out
    env.gates[(EP.key, 1)].set()
    with pytest.raises(ParticipantRefused, match="lease_expired") as info:
        await run  # turn 1 was under way and ends; boundary 2 refuses it
    assert "the run lease of dispatcher-1 ran out" in str(info.value)
    (entry,) = part.applied_effects(EffectsRequest(rollouts=(EP.rollout_id,))).rollouts
    assert [e.applied_ts for e in entry.applied] == [1000.0, 1000.0]
    assert part.applied_effects(EffectsRequest(rollouts=("x_g0",))).leases == {
        "dispatcher-1": 1002.0
    }
    # A dispatch renews the lease: a new attempt runs to its end.
    result = await part.run(RunEpisode(episode=EP.next_attempt(), lease=lease))
    assert result.turns == TURNS
