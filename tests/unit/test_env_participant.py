"""The participant toolkit against a toy environment whose episodes the tests steer: each turn
passes a boundary, a model call (``generating``) and a tool call, and can be held inside any of
them (or between them, "running") until the test releases it."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rollsafe import faults
from rollsafe.engine.protocol import SamplingParams, prompt_digest, seal_prefix
from rollsafe.env import participant as participant_module
from rollsafe.env.hooks import EnvironmentHooks, EpisodeSession
from rollsafe.env.participant import RESTORE_READING, Participant
from rollsafe.env.protocol import (
    AdoptedEpisodes,
    CommitRequest,
    EpisodeRef,
    EpisodeResult,
    ForgetRequest,
    PrepareRequest,
    RenewRequest,
    RestoreRequest,
    ResumeRequest,
    RetireRequest,
    RunEpisode,
)
from rollsafe.errors import EngineUnavailable, InvalidInput, ParticipantRefused, SnapshotCorrupt
from rollsafe.testing.waiting import eventually_async

A, B, C = (EpisodeRef(rollout_id=f"run-{i}_g0", attempt=0) for i in range(3))
TURNS = 3


class Toy(EnvironmentHooks):
    name = "toy"

    def __init__(self) -> None:
        self.state: dict[str, dict[str, Any]] = {}
        self.holds: dict[str, tuple[str, asyncio.Event]] = {}
        self.installed: dict[str, dict[str, Any]] = {}
        self.exports: list[str] = []
        self.drops: list[str] = []
        self.sessions: dict[str, EpisodeSession] = {}
        self.fail_first: set[str] = set()  # these episodes' next run fails (engine down)
        self.went_on: list[tuple[str, str]] = []  # (episode key, where): held, then released
        self.fail_in_call: set[str] = set()  # these episodes' held model call fails on release

    def hold(self, ep: EpisodeRef, where: str) -> None:
        """The episode's next pass through ``where`` waits for :meth:`release`."""
        self.holds[ep.key] = (where, asyncio.Event())

    def release(self, ep: EpisodeRef) -> None:
        _, gate = self.holds.pop(ep.key)
        gate.set()

    async def _pause(self, key: str, where: str) -> None:
        held = self.holds.get(key)
        if held is not None and held[0] == where:
            await held[1].wait()
            self.went_on.append((key, where))
            if where == "generating" and key in self.fail_in_call:
                raise EngineUnavailable("the engine died mid-call")

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        key = run.episode.key
        self.sessions[key] = session
        if key in self.fail_first:
            self.fail_first.discard(key)
            raise EngineUnavailable("the engine is down")
        start = dict(session.restored) if session.restored is not None else {"turn": 0}
        state = self.state.setdefault(key, start)
        while state["turn"] < run.task.get("turns", TURNS):
            await session.boundary(state["turn"])
            async with session.generating(f"{key}/call-{state['turn']}"):
                await self._pause(key, "generating")
            with session.tool():
                await self._pause(key, "tool")
                state["turn"] += 1
            await self._pause(key, "running")
        restored = session.restored is not None
        return EpisodeResult(
            episode=run.episode, reward=1.0, turns=state["turn"], restored=restored
        )

    def export_episode(self, episode: EpisodeRef) -> dict[str, Any]:
        self.exports.append(episode.key)
        return dict(self.state[episode.key])

    def restore_episode(self, episode: EpisodeRef, record: dict[str, Any]) -> None:
        if record.get("bad"):
            raise ValueError("a bad record")
        self.installed[episode.next_attempt().key] = record

    def drop_episode(self, episode: EpisodeRef) -> None:
        self.drops.append(episode.key)
        self.installed.pop(episode.key, None)
        self.state.pop(episode.key, None)


def soon(seconds: float = 2.0) -> float:
    return time.time() + seconds


def prep(checkpoint_id: str, seconds: float = 2.0) -> PrepareRequest:
    return PrepareRequest(checkpoint_id=checkpoint_id, deadline_ts=soon(seconds))


@pytest.fixture
def toy() -> Toy:
    return Toy()


@pytest.fixture
def part(toy: Toy) -> Participant:
    return Participant("toy-0", toy, lease_grace_s=5.0, tool_wait_s=0.1)


def start(part: Participant, ep: EpisodeRef, turns: int = TURNS) -> asyncio.Task[EpisodeResult]:
    return asyncio.ensure_future(part.run(RunEpisode(episode=ep, task={"turns": turns})))


async def refused(reason: str, call: Any) -> ParticipantRefused:
    with pytest.raises(ParticipantRefused) as info:
        await call
    assert info.value.reason == reason, str(info.value)
    return info.value


async def park(part: Participant, toy: Toy, ep: EpisodeRef) -> asyncio.Task[EpisodeResult]:
    """Run ``ep`` until it is held between turns, one turn done; its run (the endpoint's)."""
    toy.hold(ep, "running")
    run = start(part, ep)
    await eventually_async(
        lambda: toy.state.get(ep.key, {}).get("turn") == 1, what=f"{ep.key} done its first turn"
    )
    return run


async def test_phase_machine_legal_path(part: Participant, tmp_path: Path) -> None:
    assert part.status().phase == "idle"
    reply = await part.prepare(prep("ck1"))
    assert reply.ready and part.status().phase == "prepared"
    assert part.status().checkpoint_id == "ck1"
    await part.commit(CommitRequest(checkpoint_id="ck1", scope=(), dest=str(tmp_path)))
    assert part.status().phase == "committed"
    assert (await part.resume(ResumeRequest(checkpoint_id="ck1"))).resumed
    assert part.status().phase == "idle" and part.status().checkpoint_id is None


async def test_illegal_transitions_are_refused(part: Participant, tmp_path: Path) -> None:
    commit = CommitRequest(checkpoint_id="ck1", scope=(), dest=str(tmp_path))
    await refused("wrong_phase", part.commit(commit))
    await refused("wrong_phase", part.renew(RenewRequest(checkpoint_id="ck1", deadline_ts=soon())))
    await part.prepare(prep("ck1"))
    await refused("other_checkpoint", part.prepare(prep("ck2")))
    other = commit.model_copy(update={"checkpoint_id": "ck2"})
    await refused("other_checkpoint", part.commit(other))
    await refused("wrong_phase", part.retire(RetireRequest(rollouts=(A,))))
    restore = RestoreRequest(
        restore_id="r1",
        source_checkpoint_id="ck0",
        root=str(tmp_path),
        scope=(),
        deadline_ts=soon(),
    )
    await refused("other_checkpoint", part.restore(restore))
    assert part.status().phase == "prepared"


async def test_resumed_id_is_refused_forever(part: Participant, tmp_path: Path) -> None:
    await part.prepare(prep("ck1"))
    first = await part.resume(ResumeRequest(checkpoint_id="ck1"))
    assert first.resumed and (await part.resume(ResumeRequest(checkpoint_id="ck1"))) == first
    await refused("checkpoint_resumed", part.prepare(prep("ck1")))
    commit = CommitRequest(checkpoint_id="ck1", scope=(), dest=str(tmp_path))
    await refused("checkpoint_resumed", part.commit(commit))
    # An id resumed before it was ever prepared (an abort that overtook its prepare) too.
    assert not (await part.resume(ResumeRequest(checkpoint_id="ck9"))).resumed
    await refused("checkpoint_resumed", part.prepare(prep("ck9")))
    assert part.status().phase == "idle"


async def test_ended_checkpoints_are_remembered_the_newest_closed_kept_deep(
    part: Participant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounded (issue 48, defect 6): an instance that lives through many checkpoints does not
    keep every one's id and resume reply."""
    monkeypatch.setattr(participant_module, "CLOSED_KEPT", 3)
    for n in range(5):
        await part.prepare(prep(f"ck{n}"))
        assert (await part.resume(ResumeRequest(checkpoint_id=f"ck{n}"))).resumed
    for n in (2, 3, 4):  # remembered: refused, their resume replayed
        await refused("checkpoint_resumed", part.prepare(prep(f"ck{n}")))
        assert (await part.resume(ResumeRequest(checkpoint_id=f"ck{n}"))).resumed
    assert (await part.prepare(prep("ck0"))).ready  # forgotten: the controller refuses it
    assert len(part._closed) == 3 and len(part._replies) <= 4


async def test_lease_expiry_resumes_by_itself_lazily(toy: Toy) -> None:
    now = [1000.0]
    part = Participant("toy-0", toy, lease_grace_s=10.0, clock=lambda: now[0])
    reply = await part.prepare(PrepareRequest(checkpoint_id="ck1", deadline_ts=1005.0))
    assert reply.lease_expires_ts == 1015.0
    renewed = await part.renew(RenewRequest(checkpoint_id="ck1", deadline_ts=1020.0))
    assert renewed.lease_expires_ts == 1030.0
    now[0] = 1029.0
    assert part.status().phase == "prepared"
    now[0] = 1030.0
    assert part.status().phase == "idle"  # nobody resumed: the instance did
    late = PrepareRequest(checkpoint_id="ck1", deadline_ts=2000.0)
    await refused("checkpoint_resumed", part.prepare(late))
    assert not (await part.resume(ResumeRequest(checkpoint_id="ck1"))).resumed
    result = await part.run(RunEpisode(episode=A, task={"turns": 1}))  # admission reopened
    assert result.turns == 1


async def test_lease_watcher_releases_parked_episodes(toy: Toy) -> None:
    part = Participant("toy-0", toy, lease_grace_s=0.05, tool_wait_s=0.1)
    part.start()
    try:
        run = await park(part, toy, A)
        prepare = asyncio.ensure_future(part.prepare(prep("ck1", 0.05)))
        toy.release(A)
        assert (await prepare).ready
        # No call to the participant from here on: only the watcher can let A go on.
        result = await asyncio.wait_for(asyncio.shield(run), 2.0)
        assert result.turns == TURNS and part._phase == "idle"
    finally:
        await part.aclose()


async def test_replay_commits_once(part: Participant, toy: Toy, tmp_path: Path) -> None:
    await park(part, toy, A)
    prepare = prep("ck1")
    both = asyncio.gather(part.prepare(prepare), part.prepare(prepare))
    toy.release(A)
    first, second = await both  # the second waited for the first and replayed it
    assert first == second and [p.episode for p in first.parked] == [A]
    commit = CommitRequest(checkpoint_id="ck1", scope=(A,), dest=str(tmp_path))
    one = await part.commit(commit)
    assert await part.commit(commit) == one
    assert await part.prepare(prepare) == first
    assert toy.exports == [A.key]
    assert len(list((tmp_path / "toy").glob("records-*.jsonl"))) == 1
    assert one.participants[0].records == 1 and one.committed == (A,)


async def test_prepare_parks_and_reports(toy: Toy) -> None:
    part = Participant("toy-0", toy, tool_wait_s=0.1)
    toy.hold(A, "generating")
    toy.hold(B, "tool")
    start(part, A)
    start(part, B)
    await park(part, toy, C)
    prepare = asyncio.ensure_future(part.prepare(prep("ck1")))
    # Once ck1 is open, prepare is waiting for the episodes (it never gives way before).
    await eventually_async(lambda: part.status().phase == "prepared", what="prepare opened ck1")
    assert not prepare.done()  # C is between turns: neither parked nor in a tool
    toy.release(C)
    reply = await prepare
    assert reply.ready and reply.blockers == ()
    parked = {p.episode.key: p for p in reply.parked}
    assert parked[A.key].activity == "generating"
    assert parked[A.key].model_call_id == f"{A.key}/call-0"
    assert (parked[C.key].activity, parked[C.key].turn) == ("boundary", 1)
    assert reply.restarts == (B,)


async def test_episode_not_at_a_boundary_blocks(part: Participant, toy: Toy) -> None:
    await park(part, toy, A)
    reply = await part.prepare(prep("ck1", 0.05))
    assert not reply.ready and reply.parked == ()
    assert len(reply.blockers) == 1 and A.key in reply.blockers[0]


async def test_parked_episode_waits_for_resume(part: Participant, toy: Toy) -> None:
    run = await park(part, toy, A)
    prepare = asyncio.ensure_future(part.prepare(prep("ck1")))
    toy.release(A)
    assert (await prepare).ready
    # Nothing to wait for: a window in which A, held by the park alone, must not move on.
    await asyncio.sleep(0.02)
    assert toy.state[A.key]["turn"] == 1 and not run.done()
    await part.resume(ResumeRequest(checkpoint_id="ck1"))
    assert (await asyncio.wait_for(asyncio.shield(run), 2.0)).turns == TURNS


async def test_prepare_right_after_resume_parks_at_the_next_boundary(
    part: Participant, toy: Toy
) -> None:
    run = await park(part, toy, A)
    prepare = asyncio.ensure_future(part.prepare(prep("ck1")))
    toy.release(A)
    assert (await prepare).parked[0].turn == 1
    await part.resume(ResumeRequest(checkpoint_id="ck1"))
    # A has been released but has not run yet: it must not count as parked at its old
    # boundary. It runs into its model call, whose response is held while ck2 is open.
    reply = await part.prepare(prep("ck2"))
    assert [(p.episode, p.turn, p.activity) for p in reply.parked] == [(A, 1, "generating")]
    await part.resume(ResumeRequest(checkpoint_id="ck2"))
    assert (await asyncio.wait_for(run, 2.0)).turns == TURNS


async def test_run_refused_while_parked_accepted_after(part: Participant) -> None:
    await part.prepare(prep("ck1"))
    await refused("checkpoint_parked", part.run(RunEpisode(episode=A)))
    assert part.status().live_episodes == 0
    await part.resume(ResumeRequest(checkpoint_id="ck1"))
    assert (await part.run(RunEpisode(episode=A))).turns == TURNS


async def test_same_episode_twice_is_refused(part: Participant, toy: Toy) -> None:
    await park(part, toy, A)
    await refused("already_running", part.run(RunEpisode(episode=A)))


async def test_commit_refuses_scope_not_parked(toy: Toy, tmp_path: Path) -> None:
    part = Participant("toy-0", toy, tool_wait_s=0.05)
    toy.hold(B, "tool")
    start(part, B)
    await eventually_async(lambda: B.key in toy.sessions, what="B started")
    reply = await part.prepare(prep("ck1"))
    assert reply.restarts == (B,)
    for scope in ((B,), (C,)):
        commit = CommitRequest(checkpoint_id="ck1", scope=scope, dest=str(tmp_path))
        error = await refused("not_parked", part.commit(commit))
        assert scope[0].key in str(error)
    assert part.status().phase == "prepared" and toy.exports == []


async def test_a_model_response_arriving_while_parked_is_held_until_resume(
    part: Participant, toy: Toy, tmp_path: Path
) -> None:
    """A call that could not be cut returns while parked: the episode must not move on, so
    the commit still exports the state prepare reported."""
    toy.hold(A, "generating")
    run = start(part, A)
    await eventually_async(lambda: A.key in toy.sessions, what="A started")
    reply = await part.prepare(prep("ck1"))
    assert reply.parked[0].activity == "generating"
    toy.release(A)  # the model call returned after all
    # The response reached the episode; unparked, the same step would run on into turn 1.
    await eventually_async(
        lambda: (A.key, "generating") in toy.went_on, what="A's model response came back"
    )
    assert toy.state[A.key]["turn"] == 0, "the episode went on into its tool call while parked"
    commit = CommitRequest(checkpoint_id="ck1", scope=(A,), dest=str(tmp_path))
    assert (await part.commit(commit)).committed == (A,)
    await part.resume(ResumeRequest(checkpoint_id="ck1"))
    assert (await asyncio.wait_for(run, 2.0)).turns == TURNS


async def test_a_model_call_failing_while_parked_is_held_until_resume_too(
    part: Participant, toy: Toy, tmp_path: Path
) -> None:
    """The engine died mid-cut: the call's error reaches the episode while it is parked. It
    waits there, so the commit still exports the episode as prepare reported it (in its
    call); after resume the run fails as the engine's error (a 503: sent again)."""
    toy.hold(A, "generating")
    toy.fail_in_call.add(A.key)
    run = start(part, A)
    await eventually_async(lambda: A.key in toy.sessions, what="A started")
    reply = await part.prepare(prep("ck1"))
    assert reply.parked[0].activity == "generating"
    toy.release(A)  # the call fails: its engine is gone
    await eventually_async(lambda: (A.key, "generating") in toy.went_on, what="A's call failed")
    assert not run.done() and part.status().live_episodes == 1
    commit = CommitRequest(checkpoint_id="ck1", scope=(A,), dest=str(tmp_path))
    assert (await part.commit(commit)).committed == (A,)
    await part.resume(ResumeRequest(checkpoint_id="ck1"))
    with pytest.raises(EngineUnavailable, match="died mid-call"):
        await asyncio.wait_for(run, 2.0)


async def test_retire_marks_refuse_runs_until_forget(part: Participant, toy: Toy) -> None:
    run = await park(part, toy, A)
    reply = await part.retire(RetireRequest(rollouts=(A, B)))
    assert reply.count == 2 and set(toy.drops) == {A.key, B.key}
    await refused("retired", asyncio.wait_for(run, 2.0))  # the running A was cancelled
    toy.holds.clear()
    assert part.status().retired == 2 and part.status().live_episodes == 0
    await refused("retired", part.run(RunEpisode(episode=A)))
    assert (await part.retire(RetireRequest(rollouts=(A,)))).count == 0  # already marked
    assert (await part.forget(ForgetRequest(rollouts=(A, C)))).count == 1
    assert (await part.run(RunEpisode(episode=A))).turns == TURNS
    await refused("retired", part.run(RunEpisode(episode=B)))


async def _committed(tmp_path: Path, *, bad: EpisodeRef | None = None) -> Path:
    """A checkpoint ck1 of A and B (each one turn in) written by another instance."""
    toy = Toy()
    part = Participant("toy-old", toy, tool_wait_s=0.05)
    for ep in (A, B):
        await park(part, toy, ep)
    prepare = asyncio.ensure_future(part.prepare(prep("ck1")))
    toy.release(A)
    toy.release(B)
    assert (await prepare).ready
    if bad is not None:
        toy.state[bad.key]["bad"] = True
    dest = tmp_path / "ck1"
    await part.commit(CommitRequest(checkpoint_id="ck1", scope=(A, B), dest=str(dest)))
    await part.resume(ResumeRequest(checkpoint_id="ck1"))
    return dest


def _restore(root: Path, scope: tuple[EpisodeRef, ...]) -> RestoreRequest:
    return RestoreRequest(
        restore_id="r1", source_checkpoint_id="ck1", root=str(root), scope=scope, deadline_ts=soon()
    )


async def test_restored_attempt_continues(part: Participant, toy: Toy, tmp_path: Path) -> None:
    root = await _committed(tmp_path)
    reply = await part.restore(_restore(root, (A,)))
    nxt = A.next_attempt()
    assert reply.restored == (nxt,) and toy.installed == {nxt.key: {"turn": 1}}
    assert await part.restore(_restore(root, (A,))) == reply  # replay
    await refused("checkpoint_parked", part.run(RunEpisode(episode=nxt)))
    await part.resume(ResumeRequest(checkpoint_id="r1"))
    result = await part.run(RunEpisode(episode=nxt))
    assert result.restored and result.turns == TURNS
    assert toy.sessions[nxt.key].restored == {"turn": 1}
    toy.state.clear()
    again = await part.run(RunEpisode(episode=nxt))  # the record was consumed by the first run
    assert not again.restored


async def test_restore_is_all_or_nothing(part: Participant, toy: Toy, tmp_path: Path) -> None:
    root = await _committed(tmp_path, bad=B)
    with pytest.raises(SnapshotCorrupt, match=B.key):
        await part.restore(_restore(root, (A, B)))
    assert toy.installed == {}
    assert set(toy.drops) == {A.next_attempt().key, B.next_attempt().key}
    assert part.status().phase == "idle"
    result = await part.run(RunEpisode(episode=A.next_attempt()))
    assert not result.restored


async def test_restore_names_missing_records(part: Participant, toy: Toy, tmp_path: Path) -> None:
    root = await _committed(tmp_path)
    with pytest.raises(SnapshotCorrupt, match=C.key):
        await part.restore(_restore(root, (A, C)))
    assert toy.installed == {} and part.status().phase == "idle"


async def test_restore_lease_expiry_keeps_the_state(toy: Toy, tmp_path: Path) -> None:
    root = await _committed(tmp_path)
    now = [time.time()]
    part = Participant("toy-0", toy, lease_grace_s=1.0, clock=lambda: now[0])
    await part.restore(_restore(root, (A,)))
    now[0] += 60
    assert part.status().phase == "idle"
    assert (await part.run(RunEpisode(episode=A.next_attempt()))).restored


async def test_a_deadline_already_past_is_refused_and_opens_nothing(part: Participant) -> None:
    with pytest.raises(InvalidInput, match="has passed"):
        await part.prepare(PrepareRequest(checkpoint_id="ck1", deadline_ts=time.time() - 1))
    assert part.status().phase == "idle"
    assert (await part.prepare(prep("ck1"))).ready  # the id was not spent


# ---- restored attempts: kept until a run succeeds; prefixes; the restore's read window -------


async def _restored_then_failed(toy: Toy, tmp_path: Path) -> tuple[Participant, EpisodeRef]:
    """A participant that restored A and resumed, whose first run of attempt n + 1 failed
    (a 503)."""
    part = Participant("toy-0", toy, lease_grace_s=5.0, tool_wait_s=0.1)
    root = await _committed(tmp_path)
    await part.restore(_restore(root, (A,)))
    await part.resume(ResumeRequest(checkpoint_id="r1"))
    nxt = A.next_attempt()
    toy.fail_first.add(nxt.key)
    with pytest.raises(EngineUnavailable):
        await part.run(RunEpisode(episode=nxt))
    return part, nxt


async def test_a_restored_record_survives_failed_runs(toy: Toy, tmp_path: Path) -> None:
    """The engine is down when attempt n + 1 first runs (a 503, which the caller retries): the
    retry continues the record, never the task (effects twice)."""
    part, nxt = await _restored_then_failed(toy, tmp_path)
    result = await part.run(RunEpisode(episode=nxt))
    assert result.restored and result.restored_at_turn == 1 and result.turns == TURNS
    assert toy.sessions[nxt.key].restored == {"turn": 1}


async def test_retiring_a_restored_attempt_drops_its_record(toy: Toy, tmp_path: Path) -> None:
    part, nxt = await _restored_then_failed(toy, tmp_path)
    await part.retire(RetireRequest(rollouts=(nxt,)))
    await part.forget(ForgetRequest(rollouts=(nxt,)))
    result = await part.run(RunEpisode(episode=nxt))
    assert not result.restored and result.restored_at_turn is None


async def test_the_lease_watcher_runs_without_start(toy: Toy) -> None:
    """Routes mounted on an app of one's own, and nobody called start(): a lapsed lease must
    still let parked episodes go."""
    part = Participant("toy-0", toy, lease_grace_s=0.05, tool_wait_s=0.1)
    run = await park(part, toy, A)
    prepare = asyncio.ensure_future(part.prepare(prep("ck1", 0.05)))
    toy.release(A)
    assert (await prepare).ready
    result = await asyncio.wait_for(asyncio.shield(run), 5.0)  # only the watcher can free A
    assert result.turns == TURNS and part.status().phase == "idle"
    await part.aclose()


async def test_a_run_arriving_while_restore_reads_its_records_is_refused(
    toy: Toy, tmp_path: Path
) -> None:
    part = Participant("toy-0", toy, lease_grace_s=5.0, tool_wait_s=0.1)
    root = await _committed(tmp_path)
    nxt = A.next_attempt()
    faults.arm(RESTORE_READING, "hold")
    try:
        restoring = asyncio.ensure_future(part.restore(_restore(root, (A,))))
        assert await asyncio.to_thread(faults.wait_reached, RESTORE_READING, 5.0)
        await refused("checkpoint_parked", part.run(RunEpisode(episode=nxt)))
        faults.release(RESTORE_READING)
        assert (await restoring).restored == (nxt,)
    finally:
        faults.disarm_all()
    await part.resume(ResumeRequest(checkpoint_id="r1"))
    result = await part.run(RunEpisode(episode=nxt))
    assert result.restored and result.restored_at_turn == 1


async def test_a_failed_restore_read_leaves_the_instance_idle(toy: Toy, tmp_path: Path) -> None:
    part = Participant("toy-0", toy, lease_grace_s=5.0, tool_wait_s=0.1)
    with pytest.raises(SnapshotCorrupt):
        await part.restore(_restore(tmp_path / "nothing-here", (A,)))
    assert part.status().phase == "idle"
    assert (await part.run(RunEpisode(episode=A.next_attempt()))).turns == TURNS


def _prefix_of(call: str, **changes: Any) -> dict[str, Any]:
    prefix = seal_prefix(
        call_id=call,
        model="0" * 64,
        prompt_digest=prompt_digest([1, 2, 3]),
        sampling=SamplingParams(seed=7, max_tokens=4),
        tokens=(5,),
        logprobs=(-0.5,),
        weight_versions=(0,),
    )
    return {**prefix.model_dump(mode="json"), **changes}


async def _committed_generating(tmp_path: Path) -> tuple[Path, str]:
    """A checkpoint of A parked inside its first model call; the call's id."""
    toy = Toy()
    part = Participant("toy-old", toy, tool_wait_s=0.05)
    toy.hold(A, "generating")
    start(part, A)
    await eventually_async(lambda: A.key in toy.sessions, what="A started")
    (parked,) = (await part.prepare(prep("ck1"))).parked
    assert parked.activity == "generating" and parked.model_call_id is not None
    dest = tmp_path / "ck1"
    await part.commit(CommitRequest(checkpoint_id="ck1", scope=(A,), dest=str(dest)))
    await part.resume(ResumeRequest(checkpoint_id="ck1"))
    toy.release(A)
    return dest, parked.model_call_id


async def test_the_cut_calls_prefix_reaches_the_restored_session(toy: Toy, tmp_path: Path) -> None:
    root, call = await _committed_generating(tmp_path)
    part = Participant("toy-0", toy, lease_grace_s=5.0, tool_wait_s=0.1)
    other = f"{B.key}/call-0"  # staged for another instance's episode: not this session's
    staged = {call: _prefix_of(call), other: _prefix_of(other)}
    request = _restore(root, (A,)).model_copy(update={"prefixes": staged})
    await part.restore(request)
    await part.resume(ResumeRequest(checkpoint_id="r1"))
    await part.run(RunEpisode(episode=A.next_attempt()))
    session = toy.sessions[A.next_attempt().key]
    assert list(session.prefixes) == [call]
    assert session.prefixes[call].tokens == (5,)


@pytest.mark.parametrize(
    ("change", "match"),
    [({"digest": "0" * 64}, "digest"), ({"tokens": []}, "tokens"), ({"call_id": "x"}, "call_id")],
)
async def test_a_staged_prefix_that_does_not_verify_refuses_the_restore(
    toy: Toy, tmp_path: Path, change: dict[str, Any], match: str
) -> None:
    root, call = await _committed_generating(tmp_path)
    part = Participant("toy-0", toy, lease_grace_s=5.0, tool_wait_s=0.1)
    staged = {call: _prefix_of(call, **change)}
    request = _restore(root, (A,)).model_copy(update={"prefixes": staged})
    with pytest.raises(SnapshotCorrupt, match=f"staged prefix of call {call}.*{match}"):
        await part.restore(request)
    assert part.status().phase == "idle" and toy.installed == {}


async def test_a_lost_instances_episodes_restore_here_beside_its_own(
    part: Participant, toy: Toy, tmp_path: Path
) -> None:
    """A restore onto a fleet without the instance that committed A and B: this one adopts
    them (read from that instance's commit) along with its own scope, which is empty here."""
    root = await _committed(tmp_path)
    manifest = json.loads((root / toy.name / "manifest.json").read_text())
    assert manifest["instance"] == "toy-old" and "portable" not in manifest  # True: as before
    adopted = AdoptedEpisodes(instance="toy-old", root=str(root), scope=(A, B))
    request = _restore(tmp_path / "mine", ()).model_copy(update={"adopted": (adopted,)})
    reply = await part.restore(request)
    assert reply.restored == (A.next_attempt(), B.next_attempt())
    assert set(toy.installed) == {A.next_attempt().key, B.next_attempt().key}
    await part.resume(ResumeRequest(checkpoint_id="r1"))
    assert (await part.run(RunEpisode(episode=B.next_attempt()))).restored


async def test_an_environment_whose_records_are_not_portable_adopts_nothing(
    part: Participant, toy: Toy, tmp_path: Path
) -> None:
    root = await _committed(tmp_path)
    toy.portable = False
    adopted = AdoptedEpisodes(instance="toy-old", root=str(root), scope=(A,))
    request = _restore(tmp_path / "mine", ()).model_copy(update={"adopted": (adopted,)})
    with pytest.raises(InvalidInput, match=r"not portable.*toy-old"):
        await part.restore(request)
    assert toy.installed == {} and part.status().phase == "idle"


def test_the_fields_added_for_lost_instances_are_left_out_while_unused() -> None:
    """A peer of an earlier rollsafe (every message ``extra="forbid"``) still reads a restore
    without adoptions and the manifest of a portable environment."""
    plain = _restore(Path("/r/me"), (A,))
    assert "adopted" not in json.loads(plain.model_dump_json())
    adopted = AdoptedEpisodes(instance="old", root="/r/old", scope=(B,))
    assert "adopted" in plain.model_copy(update={"adopted": (adopted,)}).model_dump()
    assert RestoreRequest.model_validate_json(plain.model_dump_json()) == plain


def test_a_restore_request_names_each_episode_once_across_its_scope_and_adoptions() -> None:
    adopted = AdoptedEpisodes(instance="old", root="/r/old", scope=(A,))
    with pytest.raises(ValidationError, match="scope and adopted names episode"):
        RestoreRequest(
            restore_id="r1", source_checkpoint_id="ck1", root="/r/me", scope=(A,),
            adopted=(adopted,), deadline_ts=soon(),
        )  # fmt: skip


class LegacyToy(Toy):
    """Written against the earlier toolkit: restore_episode(episode, record, prefixes)."""

    def restore_episode(  # type: ignore[override]
        self, episode: EpisodeRef, record: dict[str, Any], prefixes: dict[str, Any]
    ) -> None:
        self.installed[episode.next_attempt().key] = {"record": record, "prefixes": prefixes}


async def test_the_earlier_restore_signature_still_restores_with_a_deprecation_warning(
    tmp_path: Path,
) -> None:
    root, call = await _committed_generating(tmp_path)
    toy = LegacyToy()
    with pytest.warns(DeprecationWarning, match=r"LegacyToy.restore_episode\(episode, record, "):
        part = Participant("toy-legacy", toy, tool_wait_s=0.1)
    request = _restore(root, (A,)).model_copy(update={"prefixes": {call: _prefix_of(call)}})
    assert (await part.restore(request)).restored == (A.next_attempt(),)
    installed = toy.installed[A.next_attempt().key]
    assert installed["prefixes"] == {call: _prefix_of(call)}  # as the earlier toolkit gave them
    assert installed["record"] == {"turn": 0}
    assert not Participant("toy-now", Toy()).legacy  # today's signature: no warning, no shim
