"""`rollsafe inspect`: what a stuck snapshot looks like to an operator, with and without a
live worker (describe and search attributes only)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from rollsafe.activities.controllers import LocalControllerClient
from rollsafe.checkpoint.controller import Controller
from rollsafe.cli.inspection import inspect_run, render
from rollsafe.core.config import RunConfig
from rollsafe.core.phases import Phase, SnapshotSpec
from rollsafe.core.run_state import RunState
from rollsafe.dataplane import make_dataplane
from rollsafe.faults import arm, disarm_all
from rollsafe.snapshot import SnapshotStore
from rollsafe.temporal.connect import connect
from rollsafe.temporal.devserver import DevServer
from rollsafe.workers.checkpoint import build_worker
from rollsafe.workflows.models import PhaseOptions, SnapshotInput
from rollsafe.workflows.snapshot import RolloutSnapshot
from rollsafe.workflows.supervisor import task_queue_for


async def _eventually(check, timeout_s: float = 10.0):
    """Visibility (list by search attribute) is eventually consistent on the server."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = await check()
        if result is not None or asyncio.get_running_loop().time() > deadline:
            return result
        await asyncio.sleep(0.1)


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
    arm("phase.drain.before", "sleep:4")
    try:
        worker = build_worker(client, task_queue_for(run_id), lambda _: local)
        async with worker:
            handle = await client.start_workflow(
                RolloutSnapshot.run,
                SnapshotInput(spec=SnapshotSpec(run_id=run_id, seq=1), options=PhaseOptions()),
                id=f"rollsafe/{run_id}/snapshot/1",
                task_queue=task_queue_for(run_id),
            )
            while (await handle.query(RolloutSnapshot.status)).phase != Phase.DRAIN:
                await asyncio.sleep(0.05)

            async def stuck_in_drain():
                view = await inspect_run(client, run_id)
                return view if view.snapshots and view.snapshots[0].phase == "drain" else None

            live = await _eventually(stuck_in_drain)
        assert live is not None, "the running snapshot never showed up in phase drain"
        (snapshot,) = live.snapshots
        assert snapshot.workflow_id == f"rollsafe/{run_id}/snapshot/1"
        assert [p.activity for p in snapshot.pending] == ["drain"]
        assert snapshot.pending[0].attempt == 1
        assert live.supervisor == "absent"  # started without a supervisor
        assert live.workers is not None and live.workers.present

        # The worker is gone: the phase is still visible from the server alone.
        await asyncio.sleep(0.1)
        dead = await inspect_run(client, run_id)
        assert [s.phase for s in dead.snapshots] == ["drain"]
        text = render(dead)
        assert "phase drain" in text and "waiting on activity drain" in text
        await handle.terminate("test over")
    finally:
        disarm_all()


async def test_inspect_says_when_no_worker_serves_the_run(server: DevServer) -> None:
    client = await connect(server.settings())
    view = await inspect_run(client, f"unserved-{uuid.uuid4().hex[:8]}")
    assert view.workers is not None and not view.workers.present
    assert "no checkpoint worker polls task queue 'rollsafe.unserved-" in render(view)
