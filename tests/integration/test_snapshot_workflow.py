"""The snapshot workflows on a real Temporal dev server with a real worker, the controller in
this process (the Ray actor and killed-worker tests live in test_checkpoint_crash.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from activities.controllers import LocalController
from rollsafe.config import RunConfig
from rollsafe.controller import Controller
from rollsafe.coordinator import CheckpointOps
from rollsafe.dataplane import make_dataplane
from rollsafe.faults import arm, disarm_all
from rollsafe.phases import PHASES, Phase, RestoreRequest, SnapshotSpec
from rollsafe.scenario import row_content
from rollsafe.snapshot import SnapshotStore
from rollsafe.temporal.connect import connect
from rollsafe.temporal.devserver import DevServer
from workers.checkpoint import build_worker
from workflows.models import PhaseOptions, SnapshotInput, SupervisorConfig, SupervisorInput
from workflows.restore import RestoreRun, restore_workflow_id
from workflows.snapshot import RolloutSnapshot
from workflows.supervisor import SnapshotSupervisor, supervisor_id

FAST = PhaseOptions(retry_initial_s=0.05, retry_maximum_s=0.2, retry_attempts=3)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    dev = DevServer(tmp_path_factory.mktemp("temporal"))
    try:
        asyncio.run(dev.start())
        yield dev
    finally:
        dev.stop()


def busy_controller(run_id: str) -> Controller:
    run = Controller(
        RunConfig(run_id=run_id, group_size=2, groups_per_step=2), make_dataplane("memory")
    )
    run.handout([0, 1, 2])
    for idx, siblings in ((0, (0, 1)), (1, (0,))):
        for i in siblings:
            run.dispatch(idx, i)
            run.seal(idx, i, 0, row_content(idx, i, 0))
    return run


class Harness:
    def __init__(self, client: Client, tmp_path: Path) -> None:
        self.client = client
        self.run_id = f"wf-{uuid.uuid4().hex[:8]}"
        self.task_queue = f"rollsafe.{self.run_id}"
        self.store = SnapshotStore(tmp_path, self.run_id)
        self.ops = CheckpointOps(busy_controller(self.run_id), self.store)
        self.local = LocalController(self.ops)

    def worker(self) -> Worker:
        return build_worker(self.client, self.task_queue, lambda run_id: self.local)

    async def snapshot(self, seq: int = 1, **update: object):
        spec = SnapshotSpec(run_id=self.run_id, seq=seq)
        return await self.client.execute_workflow(
            RolloutSnapshot.run,
            SnapshotInput(spec=spec, options=FAST),
            id=f"rollsafe/{self.run_id}/snapshot/{seq}",
            task_queue=self.task_queue,
        )


@pytest.fixture
async def harness(server: DevServer, tmp_path: Path) -> AsyncIterator[Harness]:
    client = await connect(server.settings())
    yield Harness(client, tmp_path)
    disarm_all()
    await asyncio.sleep(0.1)  # sdk-python #300: let worker threads settle


async def test_a_snapshot_runs_the_ten_phases_once_and_publishes(harness: Harness) -> None:
    async with harness.worker():
        outcome = await harness.snapshot()
    assert outcome.status == "published", outcome.reason
    assert [r.phase for r in outcome.phases] == list(PHASES)
    assert outcome.published is not None and outcome.published.counts["sealed_rollouts"] == 3
    status = harness.ops.status()
    assert status.gate_open and status.open_checkpoint is None
    assert all(status.effects[p.value] == 1 for p in (Phase.OPEN, Phase.CAPTURE, Phase.PUBLISH))
    _, plan = Controller.restore(
        harness.ops.controller.config, harness.store, make_dataplane("memory")
    )
    assert plan.checkpoint_id == outcome.checkpoint_id and plan.ready == [0]


async def test_a_transient_phase_failure_is_retried(harness: Harness) -> None:
    arm("phase.capture.before", "raise", times=2)
    async with harness.worker():
        outcome = await harness.snapshot()
    assert outcome.status == "published"
    assert harness.ops.status().effects["capture"] == 1


async def test_a_persistent_failure_fails_the_snapshot_and_reopens_admission(
    harness: Harness,
) -> None:
    arm("phase.capture.before", "raise")
    async with harness.worker():
        outcome = await harness.snapshot()
    assert outcome.status == "failed" and outcome.transient
    assert outcome.error_type == "InjectedFault"
    status = harness.ops.status()
    assert status.gate_open and status.open_checkpoint is None
    assert harness.store.list() == []


async def test_abort_before_capture_skips_and_after_is_too_late(harness: Harness) -> None:
    arm("phase.drain.before", "sleep:2")
    async with harness.worker():
        handle = await harness.client.start_workflow(
            RolloutSnapshot.run,
            SnapshotInput(spec=SnapshotSpec(run_id=harness.run_id, seq=1), options=FAST),
            id=f"rollsafe/{harness.run_id}/snapshot/1",
            task_queue=harness.task_queue,
        )
        while (await handle.query(RolloutSnapshot.status)).phase != Phase.DRAIN:
            await asyncio.sleep(0.05)
        answer = await handle.execute_update(RolloutSnapshot.abort, "trainer step 7")
        assert "drain" in answer
        outcome = await handle.result()
        assert outcome.status == "skipped" and "trainer step 7" in outcome.reason
        assert harness.store.list() == [] and harness.ops.status().gate_open

        disarm_all()
        arm("phase.publish.before", "sleep:2")
        handle = await harness.client.start_workflow(
            RolloutSnapshot.run,
            SnapshotInput(spec=SnapshotSpec(run_id=harness.run_id, seq=2), options=FAST),
            id=f"rollsafe/{harness.run_id}/snapshot/2",
            task_queue=harness.task_queue,
        )
        while (await handle.query(RolloutSnapshot.status)).phase != Phase.PUBLISH:
            await asyncio.sleep(0.05)
        with pytest.raises(WorkflowUpdateFailedError) as late:
            await handle.execute_update(RolloutSnapshot.abort, "trainer step 8")
        assert "too late" in str(late.value.cause)
        assert (await handle.result()).status == "published"


async def test_supervisor_counts_consecutive_failures_then_fails(harness: Harness) -> None:
    arm("phase.capture.before", "raise")
    config = SupervisorConfig(run_id=harness.run_id, max_consecutive_failures=2, options=FAST)
    async with harness.worker():
        handle = await harness.client.start_workflow(
            SnapshotSupervisor.run,
            SupervisorInput(config=config),
            id=supervisor_id(harness.run_id),
            task_queue=harness.task_queue,
        )
        first = await handle.execute_update(SnapshotSupervisor.snapshot_now)
        assert first.status == "failed" and first.seq == 1
        status = await handle.query(SnapshotSupervisor.status)
        assert status.state.consecutive_failures == 1
        second = await handle.execute_update(SnapshotSupervisor.snapshot_now)
        assert second.status == "failed" and second.seq == 2
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        cause = failed.value.cause
        assert isinstance(cause, ApplicationError)
        assert cause.type == "TooManyConsecutiveSnapshotFailures" and cause.non_retryable
    assert harness.ops.status().gate_open


async def test_supervisor_snapshot_now_publishes_and_resets_the_count(harness: Harness) -> None:
    arm("phase.capture.before", "raise", times=3)  # the first snapshot's 3 attempts
    config = SupervisorConfig(run_id=harness.run_id, options=FAST)
    async with harness.worker():
        handle = await harness.client.start_workflow(
            SnapshotSupervisor.run,
            SupervisorInput(config=config),
            id=supervisor_id(harness.run_id),
            task_queue=harness.task_queue,
        )
        assert (await handle.execute_update(SnapshotSupervisor.snapshot_now)).status == "failed"
        second = await handle.execute_update(SnapshotSupervisor.snapshot_now)
        assert second.status == "published" and second.seq == 2
        status = await handle.query(SnapshotSupervisor.status)
        assert status.state.consecutive_failures == 0 and status.state.published == 1
        await handle.signal(SnapshotSupervisor.stop)
        await handle.result()


async def test_restore_workflow_brings_the_run_back_from_its_newest_snapshot(
    harness: Harness,
) -> None:
    async with harness.worker():
        assert (await harness.snapshot()).status == "published"
        # The run moves on after the snapshot: one more seal that the restore must undo.
        live = harness.ops.controller
        live.dispatch(2, 0)
        live.seal(2, 0, 0, row_content(2, 0, 0))
        request = RestoreRequest(run_id=harness.run_id, restore_id="r1")
        plan = await harness.client.execute_workflow(
            RestoreRun.run,
            request,
            id=restore_workflow_id(harness.run_id, "r1"),
            task_queue=harness.task_queue,
        )
        again = await harness.client.execute_workflow(
            RestoreRun.run,
            request,
            id=restore_workflow_id(harness.run_id, "r1-retry"),
            task_queue=harness.task_queue,
        )
    assert plan.ready == [0] and sorted(plan.partial) == [1, 2]
    assert plan.partial[1].restored == [0] and plan.partial[2].restored == []
    assert again == plan  # idempotent per restore id: the run was not restored twice
    assert harness.ops.controller is not live
    assert harness.ops.controller.ledger.sealed(2) == []


async def test_restore_without_a_snapshot_fails_naming_it(harness: Harness) -> None:
    async with harness.worker():
        with pytest.raises(WorkflowFailureError) as failed:
            await harness.client.execute_workflow(
                RestoreRun.run,
                RestoreRequest(run_id=harness.run_id, restore_id="r0"),
                id=restore_workflow_id(harness.run_id, "r0"),
                task_queue=harness.task_queue,
            )
    cause = failed.value.cause.cause  # WorkflowFailure -> ActivityError -> ApplicationError
    assert isinstance(cause, ApplicationError) and cause.type == "NoValidSnapshot"
    assert cause.non_retryable and "no snapshot" in str(cause)
