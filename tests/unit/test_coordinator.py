"""Controller: the ten phases, idempotent per (checkpoint, phase), on a real controller,
memory data plane and snapshot store."""

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollsafe.checkpoint.controller import ABORT, Controller
from rollsafe.checkpoint.participants import Participants
from rollsafe.core.config import RunConfig
from rollsafe.core.ids import checkpoint_id_for
from rollsafe.core.phases import PHASES, Phase, PhaseRequest, PhaseResult, SnapshotSpec
from rollsafe.core.run_state import ROLLOUT_PARTITION, RunState
from rollsafe.core.states import AttemptState
from rollsafe.dataplane import make_dataplane
from rollsafe.dataplane.memory import MemoryDataPlane
from rollsafe.errors import (
    CheckpointBusy,
    CheckpointRefused,
    EnvUnavailable,
    InjectedFault,
    InvalidInput,
    LedgerInvariantViolation,
    SnapshotLost,
)
from rollsafe.evidence.scenario import row_content
from rollsafe.faults import ENV_VAR, arm, disarm_all
from rollsafe.loop_thread import LoopThread
from rollsafe.snapshot import EntryState, SnapshotStore, state_files
from rollsafe.testing.waiting import holding

RUN = "ops"
SPEC = SnapshotSpec(run_id=RUN, seq=1)
EXPECTED_COUNTS = {
    "groups": 4,
    "sealed_rollouts": 5,
    "claimed_groups": 0,
    "retirements": 0,
    # The fixture's 17 journal records (a hand-out, 8 dispatches, 7 seals, a commit): the snapshot
    # covers those, never a change made after its capture.
    "journal_position": 17,
}


@pytest.fixture(autouse=True)
def _no_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(ENV_VAR, raising=False)
    disarm_all()
    yield
    disarm_all()


def config() -> RunConfig:
    return RunConfig(run_id=RUN, group_size=2, groups_per_step=2)


def busy(service: Controller) -> Controller:
    """Groups 0-1 ready, 2 half done, 3 never dispatched, 4 trained."""
    service.handout([0, 1, 2, 3, 4])
    for idx, i in [(0, 0), (0, 1), (1, 0), (1, 1), (4, 0), (4, 1), (2, 0)]:
        episode = service.dispatch(idx, i)
        assert episode is not None
        service.seal(idx, i, episode.attempt, row_content(idx, i, episode.attempt))
    service.dispatch(2, 1)
    service.commit_step([4])
    return service


@pytest.fixture
def ops(tmp_path: Path) -> Controller:
    return busy(Controller(config(), tmp_path))


def run(ops: Controller, phase: Phase, spec: SnapshotSpec = SPEC) -> PhaseResult:
    return ops.run_phase(PhaseRequest(spec=spec, phase=phase))


def run_all(ops: Controller, spec: SnapshotSpec = SPEC) -> list[PhaseResult]:
    return [run(ops, phase, spec) for phase in PHASES]


def published(store: SnapshotStore) -> list[str]:
    return [e.name for e in store.list() if e.state == EntryState.VALID]


def drafts(store: SnapshotStore) -> list[str]:
    return [e.name for e in store.list() if e.state == EntryState.TEMP]


ONCE = {**{p.value: 1 for p in PHASES}, ABORT: 0}
for _p in (Phase.RETIRE_DROPPED, Phase.PREPARE_ENVS, Phase.DRAIN, Phase.CUT_GENERATION):
    ONCE[_p.value] = 0
ONCE[Phase.COMMIT_ENVS.value] = 0


def test_ten_phases_publish_a_snapshot_the_controller_restores(ops: Controller) -> None:
    results = run_all(ops)
    assert [r.phase for r in results] == list(PHASES)
    assert not any(r.replayed for r in results)
    capture, publish = results[PHASES.index(Phase.CAPTURE)], results[-1]
    assert capture.counts == EXPECTED_COUNTS
    info = publish.published
    assert info is not None and info.checkpoint_id == SPEC.checkpoint_id == checkpoint_id_for(
        "ops", 1, "rollout"
    )
    assert (info.name, info.weight_version, info.loader_position) == ("00000001-rollout", 1, 5)
    assert info.counts == EXPECTED_COUNTS
    status = ops.status()
    assert (status.open_checkpoint, status.gate_open, status.effects) == (None, True, ONCE)

    restored, plan = state_files.restore(config(), ops.store, make_dataplane("memory"))
    assert (plan.snapshot, plan.checkpoint_id) == (info.name, info.checkpoint_id)
    assert (plan.loader_position, plan.weight_version, plan.ready) == (5, 1, [0, 1])
    assert sorted(plan.partial) == [2, 3]
    assert restored.dataplane.count(ROLLOUT_PARTITION) == 5


def test_every_phase_repeated_replays_and_does_nothing_again(ops: Controller) -> None:
    first = []
    for phase in PHASES:
        first.append(run(ops, phase))
        again = run(ops, phase)  # the retry of an attempt that timed out after finishing
        assert again.replayed
        assert again.model_copy(update={"replayed": False}) == first[-1]
    replays = run_all(ops)  # and the whole sequence once more, from a replayed workflow
    assert all(r.replayed for r in replays)
    assert [r.model_copy(update={"replayed": False}) for r in replays] == first
    assert ops.status().effects == ONCE
    assert published(ops.store) == ["00000001-rollout"]
    assert ops.gate.counters().closes == ops.gate.counters().opens == 1


def test_phases_without_environments_or_engines_say_so(ops: Controller) -> None:
    results = {r.phase: r for r in run_all(ops)}
    for phase in (Phase.RETIRE_DROPPED, Phase.PREPARE_ENVS, Phase.DRAIN, Phase.COMMIT_ENVS):
        assert results[phase].summary.startswith("no environment instances configured")
    assert results[Phase.CUT_GENERATION].summary.startswith("no generation engines configured")
    assert "nothing to park" in results[Phase.PREPARE_ENVS].summary


@pytest.mark.parametrize("failing", PHASES)
def test_resume_after_a_failure_in_any_phase_reopens_the_gate(
    ops: Controller, failing: Phase
) -> None:
    arm(f"phase.{failing}.before", "raise")
    for phase in PHASES:
        if phase is failing:
            with pytest.raises(InjectedFault):
                run(ops, phase)
            break
        run(ops, phase)
    disarm_all()
    resumed = run(ops, Phase.RESUME)  # the compensation, on every exit path
    assert ops.gate.is_open and ops.dispatch(3, 0) is not None
    aborted = ops.abort(SPEC)
    assert aborted.summary.startswith("aborted")
    assert published(ops.store) == [] and drafts(ops.store) == []
    assert ops.status().open_checkpoint is None
    assert resumed.phase is Phase.RESUME


@pytest.mark.parametrize("failing", PHASES)
def test_a_crash_between_done_and_recorded_is_retried_safely(
    ops: Controller, failing: Phase
) -> None:
    """The effect happened but its result was never stored: the retry runs the phase again
    and finds the effect already done."""
    arm(f"phase.{failing}.after", "raise")
    for phase in PHASES:
        if phase is failing:
            with pytest.raises(InjectedFault):
                run(ops, phase)
            disarm_all()
        result = run(ops, phase)
        assert not result.replayed
    assert result.published is not None and result.published.counts == EXPECTED_COUNTS
    assert ops.status().effects == ONCE
    assert published(ops.store) == ["00000001-rollout"]


def test_resume_of_a_checkpoint_never_opened_succeeds(ops: Controller) -> None:
    result = run(ops, Phase.RESUME)
    assert "did not hold it" in result.summary and ops.gate.is_open
    with pytest.raises(CheckpointRefused, match="already resumed"):
        run(ops, Phase.CLOSE_ADMISSION)  # would park the run with nobody left to resume


def test_a_late_resume_of_another_checkpoint_leaves_the_gate_closed(ops: Controller) -> None:
    run(ops, Phase.OPEN)
    run(ops, Phase.CLOSE_ADMISSION)
    other = run(ops, Phase.RESUME, SnapshotSpec(run_id=RUN, seq=7))
    assert "left closed" in other.summary
    assert ops.gate.holder == SPEC.checkpoint_id


def test_dispatch_waits_at_a_closed_gate(ops: Controller) -> None:
    run(ops, Phase.OPEN)
    run(ops, Phase.CLOSE_ADMISSION)
    assert ops.dispatch(3, 0) is None
    assert ops.state.ledger.state(3, 0) == AttemptState.RESERVED
    run(ops, Phase.CAPTURE)
    run(ops, Phase.RESUME)
    episode = ops.dispatch(3, 0)
    assert episode is not None and episode.attempt == 0  # the refusal spent no attempt
    # The snapshot holds the state at capture: group 3 not dispatched.
    info = run(ops, Phase.PUBLISH).published
    assert info is not None and info.counts == EXPECTED_COUNTS


def test_abort_discards_the_draft_and_refuses_the_checkpoint_afterwards(ops: Controller) -> None:
    for phase in (Phase.OPEN, Phase.CLOSE_ADMISSION, Phase.CAPTURE):
        run(ops, phase)
    assert len(drafts(ops.store)) == 1
    first = ops.abort(SPEC)
    assert "draft discarded" in first.summary and "reopened" in first.summary
    assert ops.abort(SPEC).replayed
    assert published(ops.store) == [] and drafts(ops.store) == []
    assert ops.gate.is_open and ops.status().effects[ABORT] == 1
    assert run(ops, Phase.CAPTURE).replayed  # what happened stays recorded
    for phase in (Phase.DRAIN, Phase.PUBLISH):
        with pytest.raises(CheckpointRefused, match="aborted"):
            run(ops, phase)
    assert not run(ops, Phase.RESUME).replayed  # resume is always allowed
    second = SnapshotSpec(run_id=RUN, seq=2)
    info = run_all(ops, second)[-1].published
    assert info is not None and info.name == "00000002-rollout"


def test_abort_of_a_checkpoint_never_opened(ops: Controller) -> None:
    result = ops.abort(SPEC)
    assert "no draft to discard" in result.summary
    assert ops.status().effects[ABORT] == 0


def test_an_ended_checkpoint_never_opens_again(ops: Controller) -> None:
    """A stray open (an attempt that timed out, still running) after the compensation must
    not leave a draft that blocks every later checkpoint."""
    run(ops, Phase.RESUME)
    with pytest.raises(CheckpointRefused, match="already ended"):
        run(ops, Phase.OPEN)
    assert ops.status().open_checkpoint is None and drafts(ops.store) == []


def test_publish_retried_by_a_controller_that_lost_its_draft(
    ops: Controller, tmp_path: Path
) -> None:
    info = run_all(ops)[-1].published
    fresh = Controller(config(), tmp_path)  # the actor restarted: no draft, no results
    again = run(fresh, Phase.PUBLISH)
    assert not again.replayed and again.published == info
    assert again.summary.startswith("reused the earlier publish")
    assert fresh.status().effects[Phase.PUBLISH.value] == 0


def test_publish_without_a_draft_or_a_snapshot_is_transient(tmp_path: Path) -> None:
    fresh = Controller(config(), tmp_path)
    with pytest.raises(SnapshotLost, match="not published") as caught:
        run(fresh, Phase.PUBLISH)
    assert caught.value.transient
    with pytest.raises(SnapshotLost, match="not open"):
        run(fresh, Phase.CAPTURE)


def test_publish_retried_after_the_rename(ops: Controller) -> None:
    """The store crashed after the snapshot became visible: the retry finds it on disk."""
    for phase in PHASES[:-1]:
        run(ops, phase)
    arm("store.before_latest", "raise")
    with pytest.raises(InjectedFault):
        run(ops, Phase.PUBLISH)
    disarm_all()
    info = run(ops, Phase.PUBLISH).published
    assert info is not None and info.name == "00000001-rollout"
    assert published(ops.store) == [info.name]


def test_a_second_checkpoint_cannot_open_while_one_is_open(ops: Controller) -> None:
    run(ops, Phase.OPEN)
    with pytest.raises(
        CheckpointBusy,  # transient: the open one ends, or lapses and is reclaimed
        match=re.escape(checkpoint_id_for("ops", 2, "rollout"))
        + ".*"
        + re.escape(SPEC.checkpoint_id),
    ):
        run(ops, Phase.OPEN, SnapshotSpec(run_id=RUN, seq=2))
    assert ops.status().open_checkpoint == SPEC.checkpoint_id


def test_a_failed_agreement_check_publishes_nothing_and_the_next_snapshot_can(
    ops: Controller,
) -> None:
    """The check runs on the capture after resume (the park window does not pay for it):
    a run whose rows and ledger disagree publishes nothing, and loses nothing more."""
    run(ops, Phase.OPEN)
    row = ops.state.dataplane.get(ROLLOUT_PARTITION, ["ops-0_g0"])
    ops.state.dataplane.delete(ROLLOUT_PARTITION, ["ops-0_g0"])
    for phase in PHASES[PHASES.index(Phase.OPEN) + 1 : PHASES.index(Phase.RESUME) + 1]:
        run(ops, phase)
    with pytest.raises(LedgerInvariantViolation, match="4 rollout rows but 5"):
        run(ops, Phase.PUBLISH)
    assert drafts(ops.store) == [] and published(ops.store) == []
    ops.state.dataplane.put(ROLLOUT_PARTITION, row)
    second = SnapshotSpec(run_id=RUN, seq=2)
    assert run_all(ops, second)[-1].counts == EXPECTED_COUNTS


def test_a_capture_whose_write_failed_part_way_loses_the_snapshot_and_nothing_else(
    ops: Controller,
) -> None:
    for phase in PHASES[: PHASES.index(Phase.RESUME) + 1]:
        run(ops, phase)
    arm("phase.capture.state_written", "raise")  # after resume, in publish
    with pytest.raises(InjectedFault):
        run(ops, Phase.PUBLISH)
    disarm_all()
    assert drafts(ops.store) == [] and published(ops.store) == []  # discarded at once
    with pytest.raises(SnapshotLost):  # Temporal's retry: the snapshot is taken again
        run(ops, Phase.PUBLISH)
    assert ops.state.dataplane.count(ROLLOUT_PARTITION) == 5  # the run lost nothing
    ops.commit_step([])  # the run's deletions are not held by a capture that never wrote
    second = SnapshotSpec(run_id=RUN, seq=2)
    assert run_all(ops, second)[-1].counts["sealed_rollouts"] == 5


def test_a_slow_fsync_at_publish_holds_nothing_of_the_run_and_the_snapshot_publishes(
    ops: Controller,
) -> None:
    """Disk faults (issue 22, part 4): a publish whose writes and fsyncs take seconds (held
    where the manifest is written) is not a failure. It runs after resume: admission is open
    and rollouts dispatch and seal meanwhile; once the disk answers, the snapshot publishes."""
    for phase in PHASES[: PHASES.index(Phase.RESUME) + 1]:
        run(ops, phase)
    outcome: list[PhaseResult] = []
    with holding("store.before_manifest") as slow:
        publishing = threading.Thread(target=lambda: outcome.append(run(ops, Phase.PUBLISH)))
        publishing.start()
        slow.reached()
        assert ops.status().gate_open
        episode = ops.dispatch(3, 0)
        assert episode is not None
        ops.seal(3, 0, episode.attempt, row_content(3, 0, episode.attempt))
        assert not outcome  # (listing the store waits: publish holds its directory lock)
    publishing.join(timeout=30)
    assert published(ops.store) == ["00000001-rollout"]
    assert outcome and outcome[0].published is not None
    assert outcome[0].published.counts == EXPECTED_COUNTS  # the capture, not later


def test_the_run_goes_on_between_capture_and_publish_and_the_snapshot_is_the_capture(
    ops: Controller,
) -> None:
    """Capture takes the state in the park window; publish writes after resume. Meanwhile a step
    trains groups 0 and 1 (their rows must stay readable for the write, and go after it) and a
    new rollout is sealed (it must not be in the snapshot)."""
    for phase in PHASES[: PHASES.index(Phase.RESUME) + 1]:
        run(ops, phase)
    ops.claim([0, 1], step=1)
    ops.commit_step([0, 1])
    episode = ops.dispatch(3, 0)
    assert episode is not None
    ops.seal(3, 0, episode.attempt, row_content(3, 0, episode.attempt))
    assert ops.state.dataplane.count(ROLLOUT_PARTITION) == 6  # 4 rows held for the capture
    arm("phase.publish.before", "raise")  # the worker died before publish: Temporal retries
    with pytest.raises(InjectedFault):
        run(ops, Phase.PUBLISH)
    disarm_all()
    assert published(ops.store) == []
    info = run(ops, Phase.PUBLISH).published
    assert info is not None and info.counts == EXPECTED_COUNTS
    assert ops.state.dataplane.count(ROLLOUT_PARTITION) == 2  # the held rows went
    restored, plan = state_files.restore(config(), ops.store, make_dataplane("memory"))
    assert plan.ready == [0, 1] and restored.dataplane.count(ROLLOUT_PARTITION) == 5
    assert restored.ledger.sealed(3) == []


def test_publish_before_capture_is_refused(ops: Controller) -> None:
    run(ops, Phase.OPEN)
    with pytest.raises(CheckpointRefused, match="before capture"):
        run(ops, Phase.PUBLISH)


def test_a_checkpoint_of_another_run_is_refused(ops: Controller) -> None:
    with pytest.raises(InvalidInput, match="not of run ops"):
        run(ops, Phase.OPEN, SnapshotSpec(run_id="other", seq=1))


def test_concurrent_duplicates_take_effect_once(ops: Controller) -> None:
    """Temporal may run an attempt beside its retry; Ray may run them on two threads."""
    for phase in PHASES:
        results: list[PhaseResult] = []

        def attempt(p: Phase = phase, out: list[PhaseResult] = results) -> None:
            out.append(run(ops, p))

        threads = [threading.Thread(target=attempt) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert len(results) == 4 and sum(not r.replayed for r in results) == 1
    assert ops.status().effects == ONCE


def test_next_seq_skips_published_and_seen_checkpoints(ops: Controller, tmp_path: Path) -> None:
    assert ops.next_seq() == 1
    run_all(ops)
    assert ops.next_seq() == 2
    ops.abort(SnapshotSpec(run_id=RUN, seq=2))  # ended without a snapshot: its id is spent
    assert ops.next_seq() == 3
    assert Controller(config(), tmp_path).next_seq() == 2  # a fresh one sees the disk


class FlakyFleet:
    """Two environment instances that cannot be reached on the first resume (the protocol's
    lease would reopen them); records every resume asked for."""

    names = ("w0", "w1")

    def __init__(self) -> None:
        self.resumes: list[str] = []

    async def resume_all(self, checkpoint_id: str) -> None:
        self.resumes.append(checkpoint_id)
        if len(self.resumes) == 1:
            raise EnvUnavailable("w0: connection refused")


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread("test-coordinator")
    yield thread
    thread.close()


def test_admission_reopens_even_when_the_environments_cannot_be_resumed(
    tmp_path: Path, loop: LoopThread
) -> None:
    flaky = FlakyFleet()
    fake = Participants(flaky, {}, loop=loop)  # type: ignore[arg-type]  # resume's calls only
    ops = busy(Controller(config(), tmp_path, participants=fake))
    run(ops, Phase.OPEN)
    run(ops, Phase.CLOSE_ADMISSION)
    with pytest.raises(EnvUnavailable):
        run(ops, Phase.RESUME)
    assert ops.status().gate_open  # episodes may be dispatched; parked instances answer 409
    again = run(ops, Phase.RESUME)  # Temporal retries the phase: the environments now resume
    assert "2 instances resumed" in again.summary and not again.replayed
    assert flaky.resumes == [SPEC.checkpoint_id] * 2
    ops.abort(SnapshotSpec(run_id=RUN, seq=2))
    assert flaky.resumes[-1] == SnapshotSpec(run_id=RUN, seq=2).checkpoint_id


class ListingDataPlane(MemoryDataPlane):
    """A memory data plane that counts the calls whose cost grows with its rows (a remote
    listing, for TransferQueue)."""

    listings = 0

    def list(self, partition: str) -> list[str]:
        self.listings += 1
        return super().list(partition)

    def count(self, partition: str) -> int:
        self.listings += 1
        return super().count(partition)


def test_the_park_window_never_lists_the_data_plane(tmp_path: Path) -> None:
    """The capture counts sealed rollouts from the ledger; the rows are checked against the
    data plane after resume, in publish."""
    dataplane = ListingDataPlane()
    ops = busy(Controller.from_parts(RunState(config(), dataplane), SnapshotStore(tmp_path, RUN)))
    for phase in PHASES[: PHASES.index(Phase.RESUME) + 1]:
        result = run(ops, phase)
    assert dataplane.listings == 0 and result.phase is Phase.RESUME
    assert run(ops, Phase.PUBLISH).counts["sealed_rollouts"] == 5
    assert dataplane.listings >= 1  # the agreement check, off the park window
