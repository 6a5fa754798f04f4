"""`rollsafe inspect`: what a stuck snapshot looks like to an operator, with and without a
live worker (describe and search attributes only)."""

from __future__ import annotations

import uuid
from pathlib import Path

from rollsafe.activities.controllers import LocalControllerClient
from rollsafe.checkpoint.controller import Controller
from rollsafe.cli.inspection import inspect_run, render
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
    # Visibility (list by search attribute) is eventually consistent on the server.
    with holding("phase.drain.before") as drain:
        worker = build_worker(client, task_queue_for(run_id), lambda _: local)
        async with worker:
            handle = await client.start_workflow(
                RolloutSnapshot.run,
                SnapshotInput(spec=SnapshotSpec(run_id=run_id, seq=1), options=PhaseOptions()),
                id=snapshot_workflow_id(run_id, 1),
                task_queue=task_queue_for(run_id),
            )
            await drain.reached_async()  # the snapshot stands in drain until the test ends
            assert (await handle.query(RolloutSnapshot.status)).phase == Phase.DRAIN

            async def stuck_in_drain():
                view = await inspect_run(client, run_id)
                return view if view.snapshots and view.snapshots[0].phase == "drain" else None

            live = await eventually_async(stuck_in_drain, what="the snapshot listed in drain")
        (snapshot,) = live.snapshots
        assert snapshot.workflow_id == snapshot_workflow_id(run_id, 1)
        assert [p.activity for p in snapshot.pending] == ["drain"]
        assert snapshot.pending[0].attempt == 1
        assert live.supervisor == "absent"  # started without a supervisor
        assert live.workers is not None and live.workers.present

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
