"""What Temporal adds to a snapshot: the same ten phases called directly vs. through Temporal.

    .venv/bin/python bench/orchestration_bench.py [--rollouts 100000] [--repeats 7]

One controller (group size 8, half the rollouts sealed with rows in the memory data plane) is
snapshotted in rotation (a) by calling ``Controller.run_phase`` for the ten phases in order
in this process, (b) by running the ``RolloutSnapshot`` workflow on the tuned local dev
server with a worker in this process whose activities call the same ``Controller``, as a run
with participants does (the park window's phases local activities, the default), and (c) the
same with ``PhaseOptions(local_park_window=False)`` (every phase a regular activity, as before
issue 21). All publish real snapshots to the same disk. Target (issue 21): Temporal adds at
most 150 ms or 30 %, whichever is larger.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from temporalio.client import Client

from rollsafe.activities.controllers import LocalControllerClient
from rollsafe.checkpoint.controller import Controller
from rollsafe.core.config import RunConfig
from rollsafe.core.ids import snapshot_workflow_id, task_queue_for
from rollsafe.core.phases import PHASES, PhaseRequest, SnapshotSpec
from rollsafe.core.run_state import RunState
from rollsafe.dataplane import make_dataplane
from rollsafe.evidence.scenario import row_content
from rollsafe.snapshot import SnapshotStore
from rollsafe.temporal.connect import connect
from rollsafe.temporal.devserver import DevServer
from rollsafe.workers.checkpoint import build_worker
from rollsafe.workflows.models import PhaseOptions, SnapshotInput
from rollsafe.workflows.snapshot import RolloutSnapshot

RUN_ID = "orchestration"
GROUP_SIZE = 8


def build(rollouts: int, root: Path) -> Controller:
    config = RunConfig(run_id=RUN_ID, group_size=GROUP_SIZE, groups_per_step=8)
    run = RunState(config, make_dataplane("memory"))
    groups = list(range(rollouts // GROUP_SIZE))
    run.handout(groups)
    for idx in groups:
        for i in range(GROUP_SIZE // 2 if idx % 2 else GROUP_SIZE):
            if idx % 2 == 0 or i < GROUP_SIZE // 2:
                run.dispatch(idx, i)
        sealed = GROUP_SIZE if idx % 4 == 0 else GROUP_SIZE // 2 if idx % 4 == 2 else 0
        for i in range(sealed):
            run.seal(idx, i, 0, row_content(idx, i, 0))
    return Controller.from_parts(run, SnapshotStore(root, RUN_ID))


def direct(ops: Controller, seq: int) -> float:
    spec = SnapshotSpec(run_id=RUN_ID, seq=seq)
    start = time.perf_counter()
    for phase in PHASES:
        ops.run_phase(PhaseRequest(spec=spec, phase=phase))
    return time.perf_counter() - start


# The arms, each a way to take the same snapshot: in process, or through Temporal with the
# park window's phases as local activities (the default) or each a regular activity (before).
ARMS = ("direct", "temporal", "regular")
OPTIONS = {"temporal": PhaseOptions(), "regular": PhaseOptions(local_park_window=False)}


async def measure(
    ops: Controller, repeats: int, root: Path, persistent: bool, first_seq: int
) -> dict[str, list[float]]:
    local = LocalControllerClient(ops)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    server_dir = root / f"temporal-{'file' if persistent else 'memory'}"
    async with DevServer(server_dir, persistent=persistent) as server:
        client = await connect(server.settings())
        async with build_worker(client, task_queue_for(RUN_ID), lambda _: local):
            seq = first_seq
            for r in range(repeats + 1):  # the first round warms every arm up, untimed
                for arm in ARMS[r % 3 :] + ARMS[: r % 3]:  # the order rotates per round
                    seq += 1
                    if arm == "direct":
                        elapsed = await asyncio.to_thread(direct, ops, seq)
                    else:
                        elapsed = await through_temporal(client, seq, OPTIONS[arm])
                    ops.store.sweep()  # retention's deletes, outside every timing
                    if r:
                        times[arm].append(elapsed)
        await asyncio.sleep(0.2)  # sdk-python #300
    return times


async def through_temporal(client: Client, seq: int, options: PhaseOptions) -> float:
    """One snapshot as a run with participants takes it (``participants=True``)."""
    start = time.perf_counter()
    outcome = await client.execute_workflow(
        RolloutSnapshot.run,
        SnapshotInput(spec=SnapshotSpec(run_id=RUN_ID, seq=seq), options=options),
        id=snapshot_workflow_id(RUN_ID, seq),
        task_queue=task_queue_for(RUN_ID),
    )
    elapsed = time.perf_counter() - start
    if outcome.status != "published":
        raise RuntimeError(f"snapshot {seq}: {outcome}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="parent of the temp dir")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix=".orchestration-bench-", dir=args.dir))
    print(f"rollouts={args.rollouts:,} repeats={args.repeats} (medians)")
    try:
        ops = build(args.rollouts, root)
        for n, persistent in enumerate((True, False)):
            first_seq = n * len(ARMS) * (args.repeats + 1)
            times = asyncio.run(measure(ops, args.repeats, root, persistent, first_seq))
            report("SQLite file, WAL" if persistent else "in-memory", times)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(server: str, times: dict[str, list[float]]) -> None:
    p = statistics.median(times["direct"])
    allowed = max(0.30 * p, 0.150)  # issue 21: 150 ms or 1.3x, whichever is larger
    print(f"dev server persistence: {server}")
    print(f"  direct (ten phases in-process): {p * 1e3:8.1f} ms")
    for arm, label in (("temporal", "local park window"), ("regular", "every phase regular")):
        t = statistics.median(times[arm])
        verdict = "met" if t - p <= allowed else "NOT met"
        print(
            f"  through Temporal, {label}: {t * 1e3:8.1f} ms, adds {(t - p) * 1e3:.1f} ms "
            f"({t / p:.2f}x); allowed {allowed * 1e3:.0f} ms: {verdict}"
        )


if __name__ == "__main__":
    main()
