"""A first checkpointed run for a fresh deployment (docs/deploy.md, "The first run").

Plays the trainer's part the way a real trainer does it, on the deployment's own Temporal
and Ray: starts the run's controller actor (snapshots written under ROLLSAFE_SNAPSHOT_ROOT by
the Ray node it lands on), puts work in flight (groups handed out, some rollouts sealed),
starts the run's checkpointing with the SDK and takes one snapshot through the checkpoint
workers, then reads the published snapshot back from the shared filesystem and verifies it.

Run it as a Ray driver inside the Ray cluster (e.g. ``kubectl exec`` into the head pod, or
``ray job submit``), with the same environment as the workers: ``ROLLSAFE_SNAPSHOT_ROOT``,
``RAY_ADDRESS`` (default ``auto``: the node's cluster), the ``TEMPORAL_*`` variables and
``ROLLSAFE_RUN_ID``, whose task queue (``rollsafe.<run id>``) the workers serve. The check runs
as a run of its own (``ROLLSAFE_SMOKE_RUN_ID``, default ``smoke-<random>``) on that queue, so it
never touches the real run's controller or snapshots: workers find a workflow's controller by
the workflow's run id. Exit 0 with one line naming the snapshot; 1 with the reason. No
environment servers or engines take part (``participants=False``).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

TIMEOUT_S = float(os.environ.get("ROLLSAFE_SMOKE_TIMEOUT_S", "120"))


def main() -> int:
    import ray

    from rollsafe.checkpoint.actor import NAMESPACE, start_controller_actor
    from rollsafe.client import Checkpointer
    from rollsafe.core.config import RunConfig
    from rollsafe.core.ids import task_queue_for
    from rollsafe.evidence.scenario import row_content
    from rollsafe.snapshot import SnapshotStore

    run_id = os.environ.get("ROLLSAFE_SMOKE_RUN_ID") or f"smoke-{uuid.uuid4().hex[:8]}"
    queue = task_queue_for(os.environ.get("ROLLSAFE_RUN_ID") or run_id)
    root = Path(os.environ.get("ROLLSAFE_SNAPSHOT_ROOT", "/shared/rollsafe"))
    address = os.environ.get("RAY_ADDRESS", "auto")
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    try:
        config = RunConfig(run_id=run_id, group_size=2, groups_per_step=2)
        actor = start_controller_actor(run_id, config, root)
        # Work in flight: group 0 sealed whole, group 1 half, group 2 only handed out.
        ray.get(actor.handout.remote([0, 1, 2]))
        for idx, i in ((0, 0), (0, 1), (1, 0)):
            episode = ray.get(actor.dispatch.remote(idx, i))
            ray.get(actor.seal.remote(idx, i, episode.attempt, row_content(idx, i, 0)))

        async def snapshot() -> str:
            checkpointer = Checkpointer(run_id, task_queue=queue, participants=False)
            await checkpointer.start()
            try:
                outcome = await checkpointer.snapshot_now(timeout=TIMEOUT_S)
            finally:
                await checkpointer.stop()
            if outcome.status != "published" or outcome.published is None:
                raise SystemExit(f"snapshot {outcome.seq} {outcome.status}: {outcome.reason}")
            return outcome.published.name

        started = time.monotonic()
        name = asyncio.run(snapshot())
        # The controller wrote it on its Ray node; this reads it back through the shared
        # filesystem and checks every file's digest.
        reader = SnapshotStore(root, run_id).select()
        if reader.name != name:
            print(f"published {name} but the newest valid snapshot is {reader.name}")
            return 1
        print(
            f"rollsafe smoke: run {run_id!r} on task queue {queue!r}: snapshot {name} "
            f"published and verified under {root / run_id} in {time.monotonic() - started:.1f}s"
        )
        return 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
