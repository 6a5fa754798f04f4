"""The run side for a framework's own rollout loop (rollsafe.SyncRollouts / Rollouts) over an
in-process controller: the documented loop end to end, dispatch waiting on admission, rows
only between claim and commit, and what a restore leaves owed."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from rollsafe.checkpoint.controller import Controller, OwedRollout
from rollsafe.core.config import RunConfig
from rollsafe.core.phases import RestoreRequest
from rollsafe.core.run_state import ROLLOUT_PARTITION
from rollsafe.errors import AdmissionClosed, AwaitingRestore, InvalidInput
from rollsafe.evidence.scenario import row_content
from rollsafe.rollouts import Rollouts, SyncRollouts
from rollsafe.snapshot import state_files
from rollsafe.testing.waiting import eventually, eventually_async

RUN = "byo"
CONFIG = RunConfig(run_id=RUN, group_size=2, groups_per_step=2, sampler="in_order")


def generate(rollouts: SyncRollouts, groups: list[int]) -> None:
    for idx in groups:
        for i in range(CONFIG.group_size):
            episode = rollouts.dispatch(idx, i)
            rollouts.seal(idx, i, episode.attempt, row_content(idx, i, episode.attempt))


def test_the_documented_loop_trains_each_group_once(tmp_path: Path) -> None:
    rollouts = SyncRollouts(Controller(CONFIG, tmp_path))
    for step in range(2):
        generate(rollouts, rollouts.handout_next(2))
        groups = rollouts.select()
        assert groups == [2 * step, 2 * step + 1]
        rollouts.claim(groups, step)
        rows = rollouts.rows(groups)
        assert sorted(rows) == groups and all(len(rows[idx]) == 2 for idx in groups)
        expected = row_content(groups[0], 1, 0)["tokens"]
        assert rows[groups[0]][1]["tokens"].tobytes() == expected.tobytes()
        rollouts.commit_step(groups)
        assert rollouts.weight_version() == step + 1
    assert rollouts.loader_position() == 4 and rollouts.owed() == []


def test_rows_are_read_between_claim_and_commit(tmp_path: Path) -> None:
    controller = Controller(CONFIG, tmp_path)
    rollouts = SyncRollouts(controller)
    generate(rollouts, rollouts.handout_next(2))
    with pytest.raises(InvalidInput, match=r"rows of groups \[0, 1\]: not claimed"):
        rollouts.rows([0, 1])
    rollouts.claim([0, 1], 0)
    rollouts.commit_step([0, 1])
    with pytest.raises(InvalidInput, match="between claim and commit_step"):
        rollouts.rows([0])
    assert controller.state.dataplane.get(ROLLOUT_PARTITION, []) == {}


def test_dispatch_waits_while_a_snapshot_holds_admission_closed(tmp_path: Path) -> None:
    controller = Controller(CONFIG, tmp_path)
    rollouts = SyncRollouts(controller)
    rollouts.handout_next(1)
    controller.gate.close("ck-1")
    got = []
    waiter = threading.Thread(target=lambda: got.append(rollouts.dispatch(0, 1)))
    waiter.start()
    # Refused at least once: the dispatch is waiting at the gate, nothing recorded yet.
    eventually(lambda: controller.gate.counters().refused >= 1, what="a refused dispatch")
    assert [o.sibling for o in rollouts.owed()] == [0, 1] and not got
    controller.gate.open("ck-1")
    waiter.join(timeout=10)
    assert [episode.key for episode in got] == [f"{RUN}-0_g1"]


def test_dispatch_past_its_timeout_is_a_typed_refusal_and_spends_nothing(tmp_path: Path) -> None:
    controller = Controller(CONFIG, tmp_path)
    rollouts = SyncRollouts(controller)
    rollouts.handout_next(1)
    controller.gate.close("ck-1")
    with pytest.raises(AdmissionClosed, match="rollout 0 of group 0"):
        rollouts.dispatch(0, 0, timeout_s=0.0)
    assert rollouts.try_dispatch(0, 0) is None
    controller.gate.open("ck-1")
    assert rollouts.try_dispatch(0, 0) is not None
    assert controller.attempt(0, 0) == 0  # the refusals spent no attempt


async def test_the_async_calls_are_the_same(tmp_path: Path) -> None:
    controller = Controller(CONFIG, tmp_path)
    rollouts = Rollouts(controller)
    [idx, other] = await rollouts.handout_next(2)
    controller.gate.close("ck-1")
    dispatching = asyncio.ensure_future(rollouts.dispatch(idx, 0))
    await eventually_async(lambda: controller.gate.counters().refused >= 1)
    controller.gate.open("ck-1")
    episode = await dispatching
    assert await rollouts.seal(idx, 0, episode.attempt, row_content(idx, 0, 0))
    assert not await rollouts.seal(idx, 0, episode.attempt, row_content(idx, 0, 0))  # a retry
    assert [o.group for o in await rollouts.owed()] == [idx, other, other]
    await rollouts.set_weight_version(3)
    assert await rollouts.weight_version() == 3
    assert not await rollouts.awaiting_restore()


def test_a_restore_leaves_owed_exactly_what_was_not_sealed(tmp_path: Path) -> None:
    first = SyncRollouts(Controller(CONFIG, tmp_path))
    [done, half] = first.handout_next(2)
    generate(first, [done])
    episode = first.dispatch(half, 0)
    first.seal(half, 0, episode.attempt, row_content(half, 0, episode.attempt))
    first.dispatch(half, 1)  # in flight at the crash
    controller = first.controller
    assert isinstance(controller, Controller)
    state_files.checkpoint(controller.state, controller.store, "ck-1")

    restarted = Controller(CONFIG, tmp_path)  # a fresh process: awaits its restore
    again = SyncRollouts(restarted)
    assert again.awaiting_restore()
    with pytest.raises(AwaitingRestore):
        again.handout_next(1)
    plan = restarted.restore(RestoreRequest(run_id=RUN, restore_id="r1"))
    assert plan.ready == [done] and plan.redispatch == [half]
    assert again.owed() == [OwedRollout(half, 1, 1, None)]  # its next attempt, any instance
    episode = again.dispatch(half, 1)
    again.seal(half, 1, episode.attempt, row_content(half, 1, episode.attempt))
    assert again.select() == [done, half] and again.owed() == []
