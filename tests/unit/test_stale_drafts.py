"""A draft nobody will finish does not stop snapshots for good, and open's disk work happens
outside the phase ledger's lock (issue 48, defects 4 and 3).

A snapshot workflow terminated between open and close_admission leaves its draft open with no
admission lease to run out: the next open discards it once no phase of it has run for its
lease, and the dead checkpoint's late phases are refused by name. The clock is the test's."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rollsafe.checkpoint.controller import Controller
from rollsafe.core.config import RunConfig
from rollsafe.core.phases import Phase, PhaseRequest, SnapshotSpec
from rollsafe.core.run_state import RunState
from rollsafe.dataplane import make_dataplane
from rollsafe.errors import CheckpointBusy, SnapshotLost
from rollsafe.snapshot import SnapshotStore
from rollsafe.snapshot._fs import TEMP_PREFIX
from rollsafe.testing.clock import HeldClock

RUN = "stale"
LEASE_S = 10.0
WAIT_S = 30.0


@pytest.fixture
def clock() -> HeldClock:
    return HeldClock(1000.0)


@pytest.fixture
def controller(tmp_path: Path, clock: HeldClock) -> Controller:
    config = RunConfig(run_id=RUN, group_size=2, groups_per_step=1)
    state = RunState(config, make_dataplane("memory"))
    return Controller.from_parts(state, SnapshotStore(tmp_path, RUN), clock=clock)


def phase(controller: Controller, seq: int, which: Phase) -> object:
    spec = SnapshotSpec(run_id=RUN, seq=seq)
    request = PhaseRequest(spec=spec, phase=which, admission_lease_s=LEASE_S)
    return controller.run_phase(request)


def drafts_on_disk(controller: Controller) -> list[str]:
    root = controller.store.snapshots_dir
    return sorted(p.name for p in root.iterdir() if p.name.startswith(TEMP_PREFIX))


def test_a_draft_left_before_close_admission_is_discarded_once_its_lease_has_passed(
    controller: Controller, clock: HeldClock, caplog: pytest.LogCaptureFixture
) -> None:
    phase(controller, 1, Phase.OPEN)  # its workflow is terminated here
    clock.now += LEASE_S / 2
    with pytest.raises(CheckpointBusy, match=r"checkpoint .*00000001 is still open"):
        phase(controller, 2, Phase.OPEN)  # within the lease: it may still come back
    clock.now += LEASE_S
    phase(controller, 2, Phase.OPEN)
    assert "no phase of it ran for 15.0 s, past its 10 s lease" in caplog.text
    assert len(drafts_on_disk(controller)) == 1  # the dead draft is gone, the new one open
    with pytest.raises(SnapshotLost, match=r"no phase of it ran for 15\.0 s"):
        phase(controller, 1, Phase.CLOSE_ADMISSION)  # its late attempt: refused by name


def test_a_checkpoint_holding_admission_closed_keeps_its_draft_past_its_idle_lease(
    controller: Controller, clock: HeldClock
) -> None:
    """While it holds the gate, the gate's own lease decides (heartbeats renew it)."""
    phase(controller, 1, Phase.OPEN)
    phase(controller, 1, Phase.CLOSE_ADMISSION)
    clock.now += LEASE_S / 2
    assert controller.renew_admission(SnapshotSpec(run_id=RUN, seq=1))
    clock.now += LEASE_S * 0.9  # idle past its lease, but the renewed gate lease has not run out
    with pytest.raises(CheckpointBusy, match="is still open"):
        phase(controller, 2, Phase.OPEN)
    phase(controller, 1, Phase.PREPARE_ENVS)  # still its draft


def test_a_phase_caught_running_is_not_idle(controller: Controller, clock: HeldClock) -> None:
    phase(controller, 1, Phase.OPEN)
    record = controller.ledger.get(SnapshotSpec(run_id=RUN, seq=1).checkpoint_id)
    assert record is not None
    controller.ledger.begin_phase(record)  # a phase of it is in flight, however long
    clock.now += LEASE_S * 3
    with pytest.raises(CheckpointBusy, match="is still open"):
        phase(controller, 2, Phase.OPEN)
    controller.ledger.end_phase(record)


def test_open_sweeps_old_drafts_without_holding_the_phase_ledgers_lock(
    controller: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    reached, release = threading.Event(), threading.Event()
    sweep = controller.store.sweep

    def held_sweep() -> list[str]:
        reached.set()
        assert release.wait(WAIT_S), "the test never released the sweep"
        return sweep()

    monkeypatch.setattr(controller.store, "sweep", held_sweep)
    with ThreadPoolExecutor(1) as pool:
        opening = pool.submit(phase, controller, 1, Phase.OPEN)
        assert reached.wait(WAIT_S)
        free = controller.ledger.lock.acquire(blocking=False)
        if free:
            controller.ledger.lock.release()
        release.set()
        opening.result(WAIT_S)
    assert free, "open held the phase ledger's lock while the store swept the disk"
