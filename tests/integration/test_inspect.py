"""`rollsafe inspect`: what a stuck snapshot looks like to an operator, with and without a
live worker (describe and search attributes only)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client

from rollsafe.activities.controllers import LocalControllerClient
from rollsafe.checkpoint.controller import Controller
from rollsafe.cli.inspection import RunView, inspect_run, render
from rollsafe.core.config import RunConfig
from rollsafe.core.ids import snapshot_workflow_id, task_queue_for
from rollsafe.core.phases import Phase, SnapshotSpec
from rollsafe.core.run_state import RunState
from rollsafe.dataplane import make_dataplane
from rollsafe.snapshot import SnapshotStore
from rollsafe.temporal.connect import connect
from rollsafe.temporal.devserver import DevServer
from rollsafe.testing.waiting import eventually_async, holding
from rollsafe.workers.checkpoint import build_worker
from rollsafe.workflows.models import PhaseOptions, SnapshotInput
from rollsafe.workflows.snapshot import RolloutSnapshot

# drain is a local activity in the park window: it shows in the search attributes once the
# worker heartbeats its workflow task, at 80 % of the task timeout (1.6 s here).
LOCAL = PhaseOptions(task_timeout_s=2)
# Every phase a regular activity: a stuck one is the pending activity, seen with no worker left
# (a worker does not stop while a local activity of its own still runs).
REGULAR = PhaseOptions(local_park_window=False)


async def start(client: Client, run_id: str, seq: int, options: PhaseOptions) -> Any:
    return await client.start_workflow(
        RolloutSnapshot.run,
        SnapshotInput(spec=SnapshotSpec(run_id=run_id, seq=seq), options=options),
        id=snapshot_workflow_id(run_id, seq),
        task_queue=task_queue_for(run_id),
        task_timeout=timedelta(seconds=options.task_timeout_s),
    )


async def stuck_in_drain(client: Client, run_id: str) -> RunView:
    async def listed() -> RunView | None:
        view = await inspect_run(client, run_id)
        return view if view.snapshots and view.snapshots[0].phase == "drain" else None

    # Visibility (list by search attribute) is eventually consistent on the server.
    return await eventually_async(listed, what="the snapshot listed in drain")


async def test_inspect_shows_the_stuck_phase_with_and_without_a_worker(
    server: DevServer, tmp_path: Path
) -> None:
    client = await connect(server.settings())
    run_id = f"insp-{uuid.uuid4().hex[:8]}"
    config = RunConfig(run_id=run_id, group_size=2, groups_per_step=1)
    ops = Controller.from_parts(
        RunState(config, make_dataplane("memory")), SnapshotStore(tmp_path, run_id)
    )
    local = LocalControllerClient(ops)
    worker = build_worker(client, task_queue_for(run_id), lambda _: local)
    async with worker:
        with holding("phase.drain.before") as drain:
            handle = await start(client, run_id, 1, LOCAL)
            await drain.reached_async()  # the snapshot stands in drain until released
            live = await stuck_in_drain(client, run_id)
        (snapshot,) = live.snapshots
        assert snapshot.workflow_id == snapshot_workflow_id(run_id, 1)
        assert snapshot.pending == []  # a local activity: inside the worker's workflow task
        assert "drain runs in the worker's workflow task" in render(live)
        assert live.supervisor == "absent"  # started without a supervisor
        assert live.workers is not None and live.workers.present
        assert (await handle.result()).status == "published"

    with holding("phase.drain.before") as drain:
        async with build_worker(client, task_queue_for(run_id), lambda _: local):
            handle = await start(client, run_id, 2, REGULAR)
            await drain.reached_async()  # the snapshot stands in drain until the test ends
            assert (await handle.query(RolloutSnapshot.status)).phase == Phase.DRAIN
            live = await stuck_in_drain(client, run_id)
        (snapshot,) = live.snapshots
        assert [p.activity for p in snapshot.pending] == ["drain"]
        assert snapshot.pending[0].attempt == 1

        # The worker is gone: the phase is still visible from the server alone.
        dead = await inspect_run(client, run_id)
        assert [s.phase for s in dead.snapshots] == ["drain"]
        text = render(dead)
        assert "phase drain" in text and "waiting on activity drain" in text
        await handle.terminate("test over")


async def test_inspect_says_when_no_worker_serves_the_run(server: DevServer) -> None:
    client = await connect(server.settings())
    view = await inspect_run(client, f"unserved-{uuid.uuid4().hex[:8]}")
    assert view.workers is not None and not view.workers.present
    assert "no checkpoint worker polls task queue 'rollsafe.unserved-" in render(view)
