"""The checkpoint worker: hosts the snapshot workflows and their activities for a run."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.worker import Worker

from activities.controllers import ControllerResolver
from activities.snapshot import SnapshotActivities
from workflows.snapshot import RolloutSnapshot
from workflows.supervisor import SnapshotSupervisor


def task_queue_for(run_id: str) -> str:
    return f"rollsafe.{run_id}"


def build_worker(client: Client, task_queue: str, resolve: ControllerResolver) -> Worker:
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[SnapshotSupervisor, RolloutSnapshot],
        activities=SnapshotActivities(resolve).all(),
    )
