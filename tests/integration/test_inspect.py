"""`rollsafe inspect`: what a stuck snapshot looks like to an operator, with and without a
live worker (describe and search attributes only); a run id the server knows nothing of is
refused (exit 2), naming where it was looked for."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from typer.testing import CliRunner

from rollsafe.activities.controllers import LocalControllerClient
from rollsafe.checkpoint.controller import Controller
from rollsafe.cli.app import app
from rollsafe.cli.inspection import RunView, inspect_run, render
from rollsafe.core.config import RunConfig
from rollsafe.core.ids import snapshot_workflow_id, supervisor_id, task_queue_for
from rollsafe.core.phases import Phase, SnapshotSpec
from rollsafe.core.run_state import RunState
from rollsafe.dataplane import make_dataplane
from rollsafe.errors import RunNotFound
from rollsafe.snapshot import SnapshotStore
from rollsafe.temporal.connect import ConnectionSettings, connect
from rollsafe.temporal.devserver import DevServer
from rollsafe.testing.waiting import eventually_async, holding
from rollsafe.workers.checkpoint import build_worker
from rollsafe.workflows.models import (
    PhaseOptions,
    SnapshotInput,
    SupervisorConfig,
    SupervisorInput,
)
from rollsafe.workflows.snapshot import RolloutSnapshot
from rollsafe.workflows.supervisor import SnapshotSupervisor

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
    view: RunView | None = await eventually_async(listed, what="the snapshot listed in drain")
    assert view is not None
    return view


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
    run_id = f"unserved-{uuid.uuid4().hex[:8]}"
    # A snapshot started with no worker: no supervisor, no search attribute yet; the run is
    # known by its task queue (visibility is eventually consistent: until then, not found).
    handle = await start(client, run_id, 1, REGULAR)

    async def found() -> RunView | None:
        try:
            return await inspect_run(client, run_id)
        except RunNotFound:
            return None

    view: RunView | None = await eventually_async(
        found, what="the unserved run known by its task queue"
    )
    assert view is not None
    assert view.workers is not None and not view.workers.present
    assert "no checkpoint worker polls task queue 'rollsafe.unserved-" in render(view)
    await handle.terminate("test over")


async def test_inspect_of_a_run_nobody_knows_names_where_it_looked(server: DevServer) -> None:
    client = await connect(server.settings())
    run_id = f"typo-{uuid.uuid4().hex[:8]}"
    with pytest.raises(RunNotFound) as caught:
        await inspect_run(client, run_id)
    message = str(caught.value)
    assert message.startswith(f"no run {run_id!r} in Temporal namespace {server.namespace!r}")
    assert server.address in message
    assert f"task queue 'rollsafe.{run_id}'" in message
    assert "\n" not in message


def inspect_cli(server: DevServer, run_id: str) -> Any:
    env = {
        "TEMPORAL_ADDRESS": server.address,
        "TEMPORAL_NAMESPACE": server.namespace,
        "TEMPORAL_CONFIG_FILE": "/nonexistent/temporal.toml",  # no user profile leaks in
        "TEMPORAL_PROFILE": None,
    }
    return CliRunner().invoke(app, ["inspect", run_id], env=env)


async def ended_supervisor(settings: ConnectionSettings, run_id: str) -> None:
    """A run whose supervisor was started and terminated (describe is strongly consistent,
    unlike visibility: the run is known at once)."""
    client = await connect(settings)
    handle = await client.start_workflow(
        SnapshotSupervisor.run,
        SupervisorInput(config=SupervisorConfig(run_id=run_id)),
        id=supervisor_id(run_id),
        task_queue=task_queue_for(run_id),
    )
    await handle.terminate("test: an ended run")


def test_inspect_command_exits_2_for_an_unknown_run_and_0_for_a_real_one(
    server: DevServer,
) -> None:
    # Synchronous: the command runs its own event loop.
    run_id = f"real-{uuid.uuid4().hex[:8]}"
    asyncio.run(ended_supervisor(server.settings(), run_id))
    real = inspect_cli(server, run_id)
    assert real.exit_code == 0, real.output
    assert real.stdout.startswith(f"run {run_id}: supervisor TERMINATED\n")

    typo = f"{run_id}x"
    missing = inspect_cli(server, typo)
    assert missing.exit_code == 2, missing.output
    assert missing.stdout == ""
    (line,) = missing.stderr.strip().splitlines()
    assert line.startswith(f"error: no run {typo!r} in Temporal namespace {server.namespace!r}")
    assert f"task queue 'rollsafe.{typo}'" in line and "Traceback" not in missing.output
