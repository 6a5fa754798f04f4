"""The controller's two fences (rollsafe.checkpoint.controller): a fresh controller of a run
that has published snapshots awaits its restore (docs/design.md invariant 8), and admission closed
past its lease reopens by itself and abandons its snapshot (invariant 6). A fake clock moves
the lease; nothing sleeps."""

from collections.abc import Callable
from pathlib import Path

import pytest

import rollsafe.checkpoint.restore as restore_module
from rollsafe.checkpoint.controller import Controller
from rollsafe.core.config import RunConfig
from rollsafe.core.phases import (
    PHASES,
    SKIPPING_ERRORS,
    Phase,
    PhaseRequest,
    PhaseResult,
    RestoreRequest,
    SnapshotSpec,
)
from rollsafe.dataplane import make_dataplane
from rollsafe.errors import (
    AdmissionLeaseExpired,
    AnchorPassed,
    AwaitingRestore,
    CheckpointRefused,
    NoValidSnapshot,
)
from rollsafe.evidence.scenario import busy_run, row_content
from rollsafe.snapshot import EntryState, SnapshotStore, state_files
from rollsafe.testing.clock import HeldClock

RUN = "fenced"
LEASE_S = 10.0


def run(ops: Controller, phase: Phase, seq: int = 1) -> PhaseResult:
    spec = SnapshotSpec(run_id=RUN, seq=seq)
    return ops.run_phase(PhaseRequest(spec=spec, phase=phase, admission_lease_s=LEASE_S))


def publish_one(root: Path) -> str:
    """The run before the crash: one published snapshot of a busy controller."""
    ops = Controller.from_parts(busy_run(RUN, make_dataplane("memory")), SnapshotStore(root, RUN))
    published = [run(ops, phase) for phase in PHASES][-1].published
    assert published is not None
    return published.name


def names(store: SnapshotStore) -> list[tuple[str, EntryState]]:
    return [(entry.name, entry.state) for entry in store.list()]


def config() -> RunConfig:
    return RunConfig(run_id=RUN, group_size=2, groups_per_step=2)


# ---- a fresh controller awaits its restore ------------------------------------------------


def test_a_fresh_controller_of_a_run_with_snapshots_takes_no_work_and_no_snapshot(
    tmp_path: Path, snapshot_tree: Callable[[Path], dict[str, str]]
) -> None:
    name = publish_one(tmp_path)
    before = snapshot_tree(tmp_path)
    fresh = Controller(config(), tmp_path)  # the restarted trainer's controller
    assert fresh.status().awaiting_restore
    for refused in (
        lambda: fresh.handout([0]),
        lambda: fresh.dispatch(0, 0),
        lambda: fresh.seal(0, 0, 0, row_content(0, 0, 0)),
        lambda: fresh.claim([0], 0),
        lambda: fresh.commit_step([0]),
    ):
        with pytest.raises(AwaitingRestore, match=r"restore it first.*start_over=True"):
            refused()
    with pytest.raises(AwaitingRestore, match="00000002 refused") as caught:
        run(fresh, Phase.OPEN, seq=2)  # the supervisor's periodic snapshot
    assert caught.value.transient
    assert snapshot_tree(tmp_path) == before  # nothing written, nothing retained away

    plan = fresh.restore(RestoreRequest(run_id=RUN, restore_id="r-1"))
    assert (plan.snapshot, plan.loader_position, plan.ready) == (name, 3, [0])
    assert not fresh.status().awaiting_restore
    fresh.handout([3])  # restored: the run goes on
    assert [run(fresh, phase, seq=2) for phase in PHASES][-1].published is not None


def test_start_over_says_the_run_begins_again(tmp_path: Path) -> None:
    publish_one(tmp_path)
    fresh = Controller(config(), tmp_path, start_over=True)
    assert not fresh.status().awaiting_restore
    fresh.handout([0])
    assert fresh.next_seq() == 2  # seqs go on above the old run's snapshots
    assert [run(fresh, phase, seq=2) for phase in PHASES][-1].published is not None


def test_a_controller_of_a_new_run_is_not_fenced(tmp_path: Path) -> None:
    fresh = Controller(config(), tmp_path)
    assert not fresh.status().awaiting_restore
    fresh.handout([0])


def test_a_failed_restore_leaves_the_fence_up(tmp_path: Path) -> None:
    publish_one(tmp_path)
    fresh = Controller(config(), tmp_path)
    # The trainer holds weights of version 7: neither the snapshot nor the journal reach it.
    with pytest.raises(NoValidSnapshot, match="reaches weight version 0, not the 7"):
        fresh.restore(RestoreRequest(run_id=RUN, restore_id="r-1", weight_versions=(7,)))
    assert fresh.status().awaiting_restore
    with pytest.raises(AwaitingRestore):
        fresh.handout([0])


def test_a_retried_restore_gets_its_plan_and_only_recent_plans_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounded (issue 48, defect 6): a controller restored many times keeps the newest
    KEEP_PLANS plans, which is what a retried restore activity needs."""
    publish_one(tmp_path)
    monkeypatch.setattr(restore_module, "KEEP_PLANS", 2)
    # Journal off: each restore is of the snapshot alone (the journal a restore starts would
    # not continue it for the next).
    fresh = Controller(config().model_copy(update={"journal": False}), tmp_path)
    ids = ("r-1", "r-2", "r-3")
    plans = {rid: fresh.restore(RestoreRequest(run_id=RUN, restore_id=rid)) for rid in ids}
    assert fresh.restore(RestoreRequest(run_id=RUN, restore_id="r-3")) is plans["r-3"]
    again = fresh.restore(RestoreRequest(run_id=RUN, restore_id="r-1"))
    assert again is not plans["r-1"] and again.snapshot == plans["r-1"].snapshot  # run afresh


# ---- the admission lease -------------------------------------------------------------------


@pytest.fixture
def clock() -> HeldClock:
    return HeldClock(1000.0)


@pytest.fixture
def leased(tmp_path: Path, clock: HeldClock) -> tuple[Controller, SnapshotStore]:
    store = SnapshotStore(tmp_path, RUN)
    return Controller.from_parts(busy_run(RUN, make_dataplane("memory")), store, clock=clock), store


def test_phases_renew_the_lease_while_they_run(
    leased: tuple[Controller, SnapshotStore], clock: HeldClock
) -> None:
    ops, _ = leased
    run(ops, Phase.OPEN)
    run(ops, Phase.CLOSE_ADMISSION)
    for phase in PHASES[PHASES.index(Phase.RETIRE_DROPPED) : PHASES.index(Phase.RESUME)]:
        clock.now += LEASE_S - 1  # each phase starts just inside the lease
        run(ops, phase)
    assert not ops.status().gate_open  # closed 54 s, never 10 s without a renewal
    clock.now += LEASE_S - 1
    assert ops.renew_admission(SnapshotSpec(run_id=RUN, seq=1))  # an activity's heartbeat
    clock.now += LEASE_S - 1
    run(ops, Phase.RESUME)
    assert run(ops, Phase.PUBLISH).published is not None
    assert ops.status().gate.expired == 0


def test_a_phase_that_needs_admission_closed_is_refused_when_its_checkpoint_does_not_hold_it(
    leased: tuple[Controller, SnapshotStore],
) -> None:
    """The gate's renew says False when the checkpoint does not hold it; a phase inside the
    park window then refuses to run (it used to run with admission open: a cut that is not
    one), and the snapshot publishes nothing."""
    ops, store = leased
    run(ops, Phase.OPEN)  # close_admission never ran
    with pytest.raises(CheckpointRefused, match=r"drain runs only while the checkpoint holds"):
        run(ops, Phase.DRAIN)
    assert ops.status().gate_open and ops.effects[Phase.PUBLISH.value] == 0
    run(ops, Phase.RESUME)  # the workflow's compensation: resume, then abort (discard)
    ops.abort(SnapshotSpec(run_id=RUN, seq=1))
    assert [run(ops, phase, seq=2) for phase in PHASES][-1].published is not None
    assert [e.name for e in store.list()] == ["00000002-rollout"]


def test_a_lease_that_runs_out_reopens_admission_and_abandons_the_snapshot(
    leased: tuple[Controller, SnapshotStore], clock: HeldClock
) -> None:
    ops, store = leased
    run(ops, Phase.OPEN)
    run(ops, Phase.CLOSE_ADMISSION)
    assert [e.state for e in store.list()] == [EntryState.TEMP]
    clock.now += LEASE_S  # the only worker died: nobody renews
    status = ops.status()
    assert status.gate_open and status.gate.expired == 1 and status.gate.opens == 0

    # A worker comes back and retries the next phase: refused, transient, draft gone.
    with pytest.raises(AdmissionLeaseExpired, match=r"past its 10 s lease") as caught:
        run(ops, Phase.RETIRE_DROPPED)
    assert caught.value.transient
    assert store.list() == [] and ops.status().open_checkpoint is None
    for phase in (Phase.CAPTURE, Phase.PUBLISH):
        with pytest.raises(AdmissionLeaseExpired):
            run(ops, phase)
    resumed = run(ops, Phase.RESUME)  # compensation runs, and says what happened
    assert "reopened by itself" in resumed.summary
    assert store.list() == [] and ops.effects[Phase.PUBLISH.value] == 0

    # The next snapshot starts afresh and publishes.
    assert [run(ops, phase, seq=2) for phase in PHASES][-1].published is not None


def test_a_lease_that_runs_out_after_capture_publishes_nothing(
    leased: tuple[Controller, SnapshotStore], clock: HeldClock
) -> None:
    ops, store = leased
    for phase in PHASES[: PHASES.index(Phase.RESUME)]:
        run(ops, phase)
    clock.now += LEASE_S  # died between capture and resume
    run(ops, Phase.RESUME)
    with pytest.raises(AdmissionLeaseExpired):
        run(ops, Phase.PUBLISH)
    assert store.list() == []


def test_a_new_checkpoint_opens_over_one_whose_lease_expired_unnoticed(
    leased: tuple[Controller, SnapshotStore], clock: HeldClock
) -> None:
    """No phase of the old checkpoint ever came back (its workflow was terminated): the next
    open discards its draft instead of waiting for it forever."""
    ops, store = leased
    run(ops, Phase.OPEN)
    run(ops, Phase.CLOSE_ADMISSION)
    clock.now += LEASE_S
    assert [run(ops, phase, seq=2) for phase in PHASES][-1].published is not None
    assert [e.name for e in store.list()] == ["00000002-rollout"]


def test_dispatch_is_refused_until_the_lease_runs_out(tmp_path: Path, clock: HeldClock) -> None:
    service = Controller(config(), tmp_path, clock=clock)
    service.handout([0])
    run(service, Phase.OPEN)
    run(service, Phase.CLOSE_ADMISSION)
    assert service.dispatch(0, 0) is None
    clock.now += LEASE_S
    episode = service.dispatch(0, 0)
    assert episode is not None and episode.attempt == 0


def test_controller_restore_is_unaffected_by_an_abandoned_snapshot(
    leased: tuple[Controller, SnapshotStore], clock: HeldClock, tmp_path: Path
) -> None:
    ops, store = leased
    assert [run(ops, phase) for phase in PHASES][-1].published is not None
    run(ops, Phase.OPEN, seq=2)
    run(ops, Phase.CLOSE_ADMISSION, seq=2)
    clock.now += LEASE_S
    with pytest.raises(AdmissionLeaseExpired):
        run(ops, Phase.CAPTURE, seq=2)
    _, plan = state_files.restore(config(), store, make_dataplane("memory"))
    assert plan.snapshot == "00000001-rollout"


# ---- a trainer snapshot captures at its anchor or not at all ---------------------------------


def test_a_trainer_snapshot_captures_only_at_its_anchors_weight_version(
    leased: tuple[Controller, SnapshotStore],
) -> None:
    ops, store = leased  # busy_run: weight version 0
    spec = SnapshotSpec(run_id=RUN, seq=1, kind="trainer", anchor_step=1)
    for phase in PHASES[: PHASES.index(Phase.CAPTURE)]:
        ops.run_phase(PhaseRequest(spec=spec, phase=phase))
    with pytest.raises(AnchorPassed, match=r"anchored at weight version 1.*at 0") as caught:
        ops.run_phase(PhaseRequest(spec=spec, phase=Phase.CAPTURE))
    assert not caught.value.transient and type(caught.value).__name__ in SKIPPING_ERRORS
    ops.abort(spec)
    assert store.list() == []

    at_zero = SnapshotSpec(run_id=RUN, seq=2, kind="trainer", anchor_step=0)
    results = [ops.run_phase(PhaseRequest(spec=at_zero, phase=phase)) for phase in PHASES]
    assert results[-1].published is not None and results[-1].published.weight_version == 0
