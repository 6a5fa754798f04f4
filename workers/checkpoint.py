"""The checkpoint worker: hosts the snapshot workflows and their activities for a run."""

from __future__ import annotations

import asyncio
import signal
from datetime import timedelta

from temporalio.client import Client
from temporalio.worker import Worker

from activities.controllers import ControllerResolver, RayController
from activities.snapshot import SnapshotActivities
from rollsafe.temporal.connect import ConnectionSettings, connect
from workflows.restore import RestoreRun
from workflows.snapshot import RolloutSnapshot
from workflows.supervisor import SnapshotSupervisor, task_queue_for

STICKY_TIMEOUT = timedelta(seconds=2)


def build_worker(client: Client, task_queue: str, resolve: ControllerResolver) -> Worker:
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[SnapshotSupervisor, RolloutSnapshot, RestoreRun],
        activities=SnapshotActivities(resolve).all(),
        # A killed worker's next workflow task waits on its dead sticky queue this long
        # before another worker takes it, with admission still closed: keep it short
        # (the SDK default is 10 s; replaying a snapshot's history costs milliseconds).
        sticky_queue_schedule_to_start_timeout=STICKY_TIMEOUT,
    )


async def run_worker(
    run_id: str,
    task_queue: str | None = None,
    settings: ConnectionSettings | None = None,
    ray_address: str | None = None,
) -> None:
    """Serve a run's checkpoint workflows until SIGINT/SIGTERM, then drain and stop.

    The controller is the run's named Ray actor in the cluster at ``ray_address`` (default:
    ``RAY_ADDRESS``, else the local cluster); any number of workers may serve one task queue.
    """
    import ray

    from rollsafe.actor import NAMESPACE

    if not ray.is_initialized():
        ray.init(address=ray_address or "auto", namespace=NAMESPACE, log_to_driver=False)
    client = await connect(settings)
    queue = task_queue or task_queue_for(run_id)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with build_worker(client, queue, RayController):
        print(f"rollsafe worker: run {run_id!r}, task queue {queue!r}", flush=True)
        await stop.wait()
    await asyncio.sleep(0.1)  # sdk-python #300: let the worker's threads settle
