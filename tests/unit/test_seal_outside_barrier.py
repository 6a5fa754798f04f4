"""The data plane is called outside the controller's barrier. A seal puts its row outside it
(reserve, put, mark sealed): a seal caught mid-put holds up no other seal, dispatch or read; a
different row for the same rollout is refused while it is in flight; the same row again seals
once. A step's read of its rows, and the deletes after commit_step and evict, are outside it
too (issue 48, defect 2): a remote data plane's call holds up nothing else."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from rollsafe.checkpoint.controller import Controller
from rollsafe.core.config import RunConfig
from rollsafe.core.run_state import ROLLOUT_PARTITION, RunState
from rollsafe.dataplane import Row
from rollsafe.dataplane.memory import MemoryDataPlane
from rollsafe.errors import SealConflict
from rollsafe.evidence.scenario import row_content
from rollsafe.snapshot import SnapshotStore

RUN = "seal"
WAIT_S = 30.0


class HoldingDataPlane(MemoryDataPlane):
    """Holds the put of one key until the test releases it."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.reached = threading.Event()
        self.release = threading.Event()

    def put(self, partition: str, rows: Mapping[str, Row]) -> None:
        if self.key in rows and not self.release.is_set():
            self.reached.set()
            assert self.release.wait(WAIT_S), "the test never released the held put"
        super().put(partition, rows)


@pytest.fixture
def held(tmp_path: Path) -> tuple[Controller, HoldingDataPlane]:
    dataplane = HoldingDataPlane(key=f"{RUN}-0_g0")
    config = RunConfig(run_id=RUN, group_size=2, groups_per_step=1)
    controller = Controller.from_parts(RunState(config, dataplane), SnapshotStore(tmp_path, RUN))
    controller.handout([0, 1])
    for idx, i in [(0, 0), (0, 1), (1, 0)]:
        assert controller.dispatch(idx, i) is not None
    return controller, dataplane


def test_a_seal_held_mid_put_holds_up_nothing_else(
    held: tuple[Controller, HoldingDataPlane],
) -> None:
    controller, dataplane = held
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(controller.seal, 0, 0, 0, row_content(0, 0, 0))
        assert dataplane.reached.wait(WAIT_S)
        assert controller.seal(0, 1, 0, row_content(0, 1, 0))  # another rollout: sealed
        assert controller.dispatch(1, 1) is not None
        assert controller.owned() == 2
        with pytest.raises(SealConflict, match="different content is in flight"):
            controller.seal(0, 0, 0, row_content(9, 9, 9))
        dataplane.release.set()
        assert first.result(WAIT_S)
    assert controller.state.ledger.sealed(0) == [0, 1]
    stored = dataplane.get(ROLLOUT_PARTITION, [dataplane.key])[dataplane.key]
    assert all((stored[k] == v).all() for k, v in row_content(0, 0, 0).items())


def test_the_same_row_sealed_twice_in_flight_seals_once(
    held: tuple[Controller, HoldingDataPlane],
) -> None:
    controller, dataplane = held
    row = row_content(0, 0, 0)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(controller.seal, 0, 0, 0, row)
        assert dataplane.reached.wait(WAIT_S)
        second = pool.submit(controller.seal, 0, 0, 0, row)
        dataplane.release.set()
        outcomes = sorted([first.result(WAIT_S), second.result(WAIT_S)])
    assert outcomes == [False, True]  # one applied it, the other found it applied
    assert controller.state.ledger.sealed(0) == [0]


def test_a_group_evicted_while_its_row_was_put_leaves_no_row(
    held: tuple[Controller, HoldingDataPlane],
) -> None:
    controller, dataplane = held
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(controller.seal, 0, 0, 0, row_content(0, 0, 0))
        assert dataplane.reached.wait(WAIT_S)
        controller.evict([0])
        dataplane.release.set()
        with pytest.raises(Exception, match="group 0"):
            first.result(WAIT_S)
    assert dataplane.key not in dataplane.list(ROLLOUT_PARTITION)


class HeldCallDataPlane(MemoryDataPlane):
    """Holds its next ``get`` or ``delete`` (the one named by :attr:`holding`) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.holding: str | None = None
        self.reached = threading.Event()
        self.release = threading.Event()

    def _hold(self, call: str) -> None:
        if self.holding == call:
            self.holding = None
            self.reached.set()
            assert self.release.wait(WAIT_S), "the test never released the held call"

    def get(self, partition: str, keys: Iterable[str]) -> dict[str, dict[str, np.ndarray]]:
        self._hold("get")
        return super().get(partition, keys)

    def delete(self, partition: str, keys: Iterable[str]) -> None:
        self._hold("delete")
        super().delete(partition, keys)


def sealed(controller: Controller, *, claimed: bool) -> None:
    controller.handout([0])
    for i in (0, 1):
        controller.dispatch(0, i)
        controller.seal(0, i, 0, row_content(0, i, 0))
    if claimed:
        controller.claim([0], 0)


CALLS: dict[str, tuple[str, Callable[[Controller], object]]] = {
    "rows": ("get", lambda c: c.rows([0])),
    "commit_step": ("delete", lambda c: c.commit_step([0])),
    "evict": ("delete", lambda c: c.evict([0])),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_data_plane_call_held_mid_flight_does_not_hold_the_barrier(
    tmp_path: Path, name: str
) -> None:
    dataplane = HeldCallDataPlane()
    config = RunConfig(run_id=RUN, group_size=2, groups_per_step=1)
    controller = Controller.from_parts(RunState(config, dataplane), SnapshotStore(tmp_path, RUN))
    sealed(controller, claimed=name != "evict")  # a claimed group is not evicted
    call, run = CALLS[name]
    dataplane.holding = call
    with ThreadPoolExecutor(1) as pool:
        held_call = pool.submit(run, controller)
        assert dataplane.reached.wait(WAIT_S)
        free = controller.barrier.acquire(blocking=False)
        if free:
            controller.barrier.release()
        dataplane.release.set()
        outcome = held_call.result(WAIT_S)
    assert free, f"{name} held the barrier across the data plane's {call}"
    if name == "rows":
        assert isinstance(outcome, dict) and len(outcome[0]) == 2
    else:
        assert dataplane.list(ROLLOUT_PARTITION) == []  # the rows went, after the barrier
