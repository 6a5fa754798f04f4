"""A seal puts its row into the data plane outside the controller's barrier (reserve, put,
mark sealed): a seal caught mid-put holds up no other seal, dispatch or read; a different row
for the same rollout is refused while it is in flight; the same row again seals once."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
