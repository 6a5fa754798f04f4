"""Integration fixtures: one Temporal dev server per session (Ray and TransferQueue are in
the root conftest), and a harness that serves a run's workflows with its controller in this
process."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from rollsafe.core.ids import snapshot_workflow_id

# Fast retries so failure paths finish in a second (rollsafe.workflows.models.PhaseOptions).
# task_timeout_s: a query or an update reaches a snapshot whose park-window phase (a local
# activity) a test holds when the worker heartbeats its workflow task, at 80 % of it.
FAST_RETRY = {
    "retry_initial_s": 0.05,
    "retry_maximum_s": 0.2,
    "retry_attempts": 3,
    "task_timeout_s": 2.0,
}


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One Temporal dev server for the session; tests keep apart by run id and task queue.
    A sync fixture: the server is a process, not a loop resource."""
    from rollsafe.temporal.devserver import DevServer

    dev = DevServer(tmp_path_factory.mktemp("temporal"))
    try:
        asyncio.run(dev.start())
        yield dev
    finally:
        dev.stop()


class WorkflowHarness:
    """A run whose controller lives in this process, served by workers built on demand."""

    def __init__(self, client: Any, tmp_path: Path) -> None:
        from rollsafe.activities.controllers import LocalControllerClient
        from rollsafe.checkpoint.controller import Controller
        from rollsafe.core.ids import task_queue_for
        from rollsafe.dataplane import make_dataplane
        from rollsafe.evidence.scenario import busy_run
        from rollsafe.snapshot import SnapshotStore

        self.client = client
        self.run_id = f"wf-{uuid.uuid4().hex[:8]}"
        self.task_queue = task_queue_for(self.run_id)
        self.store = SnapshotStore(tmp_path, self.run_id)
        self.controller = Controller.from_parts(
            busy_run(self.run_id, make_dataplane("memory")), self.store
        )
        self.local = LocalControllerClient(self.controller)

    def worker(self) -> Any:
        from rollsafe.workers.checkpoint import build_worker

        return build_worker(self.client, self.task_queue, lambda run_id: self.local)

    def snapshot_workflow_id(self, seq: int) -> str:
        return snapshot_workflow_id(self.run_id, seq)

    async def start_snapshot(self, seq: int = 1, **fields: Any) -> Any:
        """Start RolloutSnapshot ``seq`` directly (fast retries unless ``options`` given)."""
        from rollsafe.core.phases import SnapshotSpec
        from rollsafe.workflows.models import PhaseOptions, SnapshotInput
        from rollsafe.workflows.snapshot import RolloutSnapshot

        fields.setdefault("options", PhaseOptions(**FAST_RETRY))
        return await self.client.start_workflow(
            RolloutSnapshot.run,
            SnapshotInput(spec=SnapshotSpec(run_id=self.run_id, seq=seq), **fields),
            id=self.snapshot_workflow_id(seq),
            task_queue=self.task_queue,
            task_timeout=timedelta(seconds=fields["options"].task_timeout_s),
        )

    async def snapshot(self, seq: int = 1, **fields: Any) -> Any:
        return await (await self.start_snapshot(seq, **fields)).result()

    async def start_supervisor(self, **config: Any) -> Any:
        """Start the run's SnapshotSupervisor (fast retries unless ``options`` given)."""
        from rollsafe.core.ids import supervisor_id
        from rollsafe.workflows.models import PhaseOptions, SupervisorConfig, SupervisorInput
        from rollsafe.workflows.supervisor import SnapshotSupervisor

        config.setdefault("options", PhaseOptions(**FAST_RETRY))
        return await self.client.start_workflow(
            SnapshotSupervisor.run,
            SupervisorInput(config=SupervisorConfig(run_id=self.run_id, **config)),
            id=supervisor_id(self.run_id),
            task_queue=self.task_queue,
        )

    async def snapshot_phase(self, seq: int) -> Any:
        from rollsafe.workflows.snapshot import RolloutSnapshot

        handle = self.client.get_workflow_handle(self.snapshot_workflow_id(seq))
        return (await handle.query(RolloutSnapshot.status)).phase


@pytest.fixture
async def harness(server: Any, tmp_path: Path) -> AsyncIterator[WorkflowHarness]:
    from rollsafe.faults import disarm_all
    from rollsafe.temporal.connect import connect

    client = await connect(server.settings())
    yield WorkflowHarness(client, tmp_path)
    disarm_all()
    await asyncio.sleep(0.1)  # sdk-python #300: let worker threads settle


@pytest.fixture
def stacks() -> Iterator[list[Any]]:
    """Generations of a test's server processes (rollsafe.testing.processes.Generation), each
    appended as it is made: all stopped at the end, also when the test failed."""
    started: list[Any] = []
    try:
        yield started
    finally:
        for stack in started:
            stack.stop()
