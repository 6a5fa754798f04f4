"""What a trainer step pays to tell its run's workflows it committed.

    .venv/bin/python bench/sdk_bench.py [--steps 200]

``Checkpointer.train_step_committed`` is one signal to the run's supervisor. The baseline,
measured in the same run against the same dev server, is what it did before: ``describe`` the
supervisor first, then an ``abort`` update to any snapshot running (which waits up to
``WORKER_TIMEOUT_S`` for a worker to answer), then the signal. Two cases:

- **idle**: a worker serves the run, no snapshot is running;
- **no worker, snapshot pending**: a snapshot was running when its only worker died (the
  trial that found this: every step then waited 5 s).

Printed: per-step median and p95 for each, and the ratio baseline / now.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from temporalio.client import (
    Client,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)

from rollsafe.activities.controllers import LocalControllerClient
from rollsafe.checkpoint.controller import Controller
from rollsafe.client import WORKER_TIMEOUT_S, Checkpointer
from rollsafe.core.ids import supervisor_id, task_queue_for
from rollsafe.core.phases import Phase, PhaseRequest, PhaseResult
from rollsafe.dataplane import make_dataplane
from rollsafe.evidence.scenario import busy_run
from rollsafe.snapshot import SnapshotStore
from rollsafe.temporal.connect import connect
from rollsafe.temporal.devserver import DevServer
from rollsafe.workers.checkpoint import build_worker
from rollsafe.workflows.snapshot import RolloutSnapshot
from rollsafe.workflows.supervisor import SnapshotSupervisor

RUN_ID = "sdk-bench"
Step = Callable[[int], Awaitable[object]]


async def describe_then_signal(client: Client, step: int) -> None:
    """The SDK before: describe, abort each pending snapshot (an update: needs a worker),
    then signal."""
    handle = client.get_workflow_handle_for(SnapshotSupervisor.run, supervisor_id(RUN_ID))
    description = await handle.describe()
    for child in description.raw_description.pending_children:
        snapshot = client.get_workflow_handle_for(RolloutSnapshot.run, child.workflow_id)
        try:
            async with asyncio.timeout(WORKER_TIMEOUT_S):
                await snapshot.execute_update(RolloutSnapshot.abort, f"step {step}")
        except (TimeoutError, WorkflowUpdateFailedError, WorkflowUpdateRPCTimeoutOrCancelledError):
            pass  # the SDK answered "unconfirmed" or "too late" and went on
    await handle.signal(SnapshotSupervisor.train_step_committed, step)


class DrainHeld(LocalControllerClient):
    """The run's controller, with every drain held until the worker goes (not a thread
    stuck in a sleep: the cancelled activity lets go of it)."""

    def __init__(self, ops: Controller) -> None:
        super().__init__(ops)
        self.draining = asyncio.Event()

    async def run_phase(self, request: PhaseRequest) -> PhaseResult:
        if request.phase == Phase.DRAIN:
            self.draining.set()
            await asyncio.Event().wait()  # until cancelled
        return await super().run_phase(request)


async def timed(step: Step, steps: int) -> list[float]:
    seconds = []
    for n in range(steps):
        start = time.perf_counter()
        await step(n)
        seconds.append(time.perf_counter() - start)
    return seconds


def line(name: str, now: list[float], before: list[float]) -> str:
    def ms(values: list[float], q: float) -> float:
        return 1000 * statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else 0

    median_now, median_before = statistics.median(now), statistics.median(before)
    return (
        f"{name:28} now median {1000 * median_now:7.2f} ms  p95 {ms(now, 95):7.2f} ms | "
        f"before median {1000 * median_before:8.2f} ms  p95 {ms(before, 95):8.2f} ms | "
        f"before/now {median_before / median_now:7.1f}x"
    )


async def main(steps: int, pending_steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with DevServer(Path(tmp) / "temporal") as server:
            client = await connect(server.settings())
            ops = Controller.from_parts(
                busy_run(RUN_ID, make_dataplane("memory")), SnapshotStore(Path(tmp), RUN_ID)
            )
            local = DrainHeld(ops)
            ckpt = Checkpointer(RUN_ID, client=client)
            worker = build_worker(client, task_queue_for(RUN_ID), lambda _: local)
            async with worker:
                await ckpt.start()
                await ckpt.status()  # the supervisor has run its first task
                idle_now = await timed(ckpt.train_step_committed, steps)
                idle_before = await timed(lambda n: describe_then_signal(client, n), steps)
                # A snapshot held in drain, then its only worker goes.
                pending = asyncio.create_task(ckpt.snapshot_now())
                await local.draining.wait()
            await asyncio.sleep(0.1)  # sdk-python #300
            orphan_now = await timed(ckpt.train_step_committed, steps)
            orphan_before = await timed(lambda n: describe_then_signal(client, n), pending_steps)
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
            await client.get_workflow_handle(supervisor_id(RUN_ID)).terminate("bench over")
    print(f"train_step_committed, {steps} steps each (before: {pending_steps} when pending)")
    print(line("idle, worker serving", idle_now, idle_before))
    print(line("no worker, snapshot pending", orphan_now, orphan_before))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pending-steps", type=int, default=3, help="5 s each, before")
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.pending_steps))
