"""Periodic snapshots against fast training steps, on an idle and a loaded machine (issue 35).

    .venv/bin/python bench/keepup_bench.py [--rollouts 20000] [--snapshots 8] [--step-s 1.0]

One controller (``orchestration_bench.build``: group size 8, part sealed, memory data plane)
served by a worker in this process on the tuned local dev server; a supervisor takes a
periodic snapshot every ``--interval-s``; a trainer loop commits a step every ``--step-s``
(the controller's weight version moves on, then ``train_step_committed``, the SDK's signal).
Each arm runs ``--snapshots`` periodic snapshots with ``--load`` busy processes beside it
(0: idle; 2: both cores busy; 8: four times the cores, the issue's trial), and prints:

- open-to-capture per snapshot (from ``open`` starting to ``capture`` returning, on the
  controller's side): median and worst, and the loaded arm's median over the idle arm's;
- how many published, and how many a step reached before their capture: every one of those
  was thrown away under the earlier rule (a step before capture skipped the snapshot), so
  ``published / (published - reached)`` is what the new rule gains in the same run;
- the shortest step at which the earlier rule would have published every snapshot of the arm
  (longer than its worst open-to-capture); under the new rule any step does.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from temporalio.client import WorkflowHandle

from rollsafe.activities.controllers import LocalControllerClient
from rollsafe.checkpoint.controller import Controller
from rollsafe.core.ids import supervisor_id, task_queue_for
from rollsafe.core.phases import Phase, PhaseRequest, PhaseResult
from rollsafe.temporal.connect import connect
from rollsafe.temporal.devserver import DevServer
from rollsafe.workers.checkpoint import build_worker
from rollsafe.workflows.models import SupervisorConfig, SupervisorInput
from rollsafe.workflows.supervisor import SnapshotSupervisor

sys.path.insert(0, str(Path(__file__).resolve().parent))
if TYPE_CHECKING:  # mypy reads bench/ as a package; run, bench/ is on sys.path
    from bench.orchestration_bench import RUN_ID, build
else:
    from orchestration_bench import RUN_ID, build


@dataclass
class Timed:
    """Per checkpoint: when open started and capture returned, and the steps committed
    between open starting and capture starting (each would have skipped it before)."""

    opened: dict[str, float] = field(default_factory=dict)
    captured: dict[str, float] = field(default_factory=dict)
    reached: set[str] = field(default_factory=set)
    in_window: set[str] = field(default_factory=set)


class TimingClient(LocalControllerClient):
    """The worker's controller client, timing ``open`` to ``capture``."""

    def __init__(self, controller: Controller, timed: Timed) -> None:
        super().__init__(controller)
        self.timed = timed

    async def run_phase(self, request: PhaseRequest) -> PhaseResult:
        checkpoint = request.spec.checkpoint_id
        if request.phase == Phase.OPEN:
            self.timed.opened.setdefault(checkpoint, time.monotonic())
            self.timed.in_window.add(checkpoint)
        if request.phase == Phase.CAPTURE:
            self.timed.in_window.discard(checkpoint)
        result = await super().run_phase(request)
        if request.phase == Phase.CAPTURE:
            self.timed.captured.setdefault(checkpoint, time.monotonic())
        return result


def spin() -> None:
    while True:
        pass


async def trainer(
    controller: Controller, handle: WorkflowHandle[Any, Any], timed: Timed, step_s: float
) -> None:
    step = controller.weight_version()
    while True:
        await asyncio.sleep(step_s)  # the training step itself
        step += 1
        await asyncio.to_thread(controller.set_weight_version, step)
        timed.reached |= timed.in_window  # before capture: the earlier rule skipped these
        await handle.signal(SnapshotSupervisor.train_step_committed, step)


async def run_arm(args: argparse.Namespace, root: Path, load: int, n: int) -> dict[str, float]:
    controller = build(args.rollouts, root / f"arm-{n}")
    timed = Timed()
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(load)]
    for proc in spinners:
        proc.start()
    try:
        async with DevServer(root / f"temporal-{n}") as server:
            client = await connect(server.settings())
            local = TimingClient(controller, timed)
            async with build_worker(client, task_queue_for(RUN_ID), lambda _: local):
                config = SupervisorConfig(run_id=RUN_ID, interval_s=args.interval_s)
                handle = await client.start_workflow(
                    SnapshotSupervisor.run,
                    SupervisorInput(config=config),
                    id=supervisor_id(RUN_ID),
                    task_queue=task_queue_for(RUN_ID),
                )
                steps = asyncio.create_task(trainer(controller, handle, timed, args.step_s))
                while True:
                    if steps.done():
                        steps.result()  # the trainer loop failed: say how
                    status = await handle.query(SnapshotSupervisor.status)
                    state = status.state
                    if state.published + state.skipped + state.failed >= args.snapshots:
                        break
                    await asyncio.sleep(0.5)
                steps.cancel()
                await handle.signal(SnapshotSupervisor.stop)
                await handle.result()
            await asyncio.sleep(0.2)  # sdk-python #300
    finally:
        for proc in spinners:
            proc.terminate()  # our own children, by pid
            proc.join()
    spans = [timed.captured[c] - timed.opened[c] for c in timed.captured if c in timed.opened]
    return {
        "median": statistics.median(spans),
        "worst": max(spans),
        "published": state.published,
        "skipped": state.skipped,
        "failed": state.failed,
        "reached": len(timed.reached & set(timed.captured)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=20_000)
    parser.add_argument("--snapshots", type=int, default=8)
    parser.add_argument("--interval-s", type=float, default=2.0)
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument("--loads", default="0,2,8", help="busy processes per arm")
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="parent of the temp dir")
    args = parser.parse_args()
    loads = [int(n) for n in args.loads.split(",")]
    root = Path(tempfile.mkdtemp(prefix=".keepup-bench-", dir=args.dir))
    print(
        f"rollouts={args.rollouts:,} snapshots={args.snapshots} every {args.interval_s:g} s, "
        f"a step every {args.step_s:g} s, {multiprocessing.cpu_count()} cores"
    )
    try:
        results = {load: asyncio.run(run_arm(args, root, load, n)) for n, load in enumerate(loads)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    idle = results[loads[0]]["median"]
    for load, r in results.items():
        earlier = r["published"] - r["reached"]
        print(
            f"load {load} busy: open-to-capture median {r['median'] * 1e3:7.1f} ms "
            f"({r['median'] / idle:.2f}x arm {loads[0]}), worst {r['worst'] * 1e3:7.1f} ms; "
            f"published {r['published']:.0f}, skipped {r['skipped']:.0f}, failed "
            f"{r['failed']:.0f}; a step reached {r['reached']:.0f} before capture (the earlier "
            f"rule: {earlier:.0f} published, {r['published'] / max(earlier, 1):.2f}x now); "
            f"the earlier rule needed steps > {r['worst']:.2f} s"
        )


if __name__ == "__main__":
    main()
