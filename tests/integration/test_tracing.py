"""Tracing: a snapshot run yields workflow, activity and phase spans with run, snapshot and
phase attributes. Runs in a subprocess: a tracer provider is process-global."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollsafe.core.ids import checkpoint_id_for

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from rollsafe.observability.tracing import configure_tracing

    exporter = InMemorySpanExporter()
    configure_tracing(SimpleSpanProcessor(exporter))

    from rollsafe.activities.controllers import LocalControllerClient
    from rollsafe.core.config import RunConfig
    from rollsafe.core.ids import snapshot_workflow_id, task_queue_for
    from rollsafe.core.run_state import RunState
    from rollsafe.checkpoint.controller import Controller
    from rollsafe.dataplane import make_dataplane
    from rollsafe.core.phases import SnapshotSpec
    from rollsafe.snapshot import SnapshotStore
    from rollsafe.temporal.connect import connect
    from rollsafe.temporal.devserver import DevServer
    from rollsafe.workers.checkpoint import build_worker
    from rollsafe.workflows.models import SnapshotInput
    from rollsafe.workflows.snapshot import RolloutSnapshot

    async def main(root: Path) -> None:
        async with DevServer(root / "temporal") as server:
            client = await connect(server.settings())
            config = RunConfig(run_id="traced", group_size=2, groups_per_step=1)
            ops = Controller.from_parts(
                RunState(config, make_dataplane("memory")), SnapshotStore(root, "traced")
            )
            local = LocalControllerClient(ops)
            async with build_worker(client, task_queue_for("traced"), lambda _: local):
                outcome = await client.execute_workflow(
                    RolloutSnapshot.run,
                    SnapshotInput(spec=SnapshotSpec(run_id="traced", seq=1)),
                    id=snapshot_workflow_id("traced", 1),
                    task_queue=task_queue_for("traced"),
                )
        # Every span ended before the workflow's result came back (an activity's when its
        # function returned, the workflow's when its run did); the processor exports each as it
        # ends. A flush makes sure none is still on its way, whatever the processor.
        assert trace.get_tracer_provider().force_flush()
        spans = [{"name": s.name, "attributes": dict(s.attributes or {})}
                 for s in exporter.get_finished_spans()]
        print(json.dumps({"status": outcome.status, "spans": spans}))

    asyncio.run(main(Path(sys.argv[1])))
    """
)


def test_a_snapshot_is_traced_per_workflow_activity_and_phase(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    if done.returncode != 0:
        pytest.fail(f"tracing script failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == "published"
    names = [span["name"] for span in result["spans"]]
    assert "RunWorkflow:RolloutSnapshot" in names
    assert "RunActivity:capture" in names
    phase_spans = {
        s["name"]: s["attributes"]
        for s in result["spans"]
        if s["name"].startswith("rollsafe.phase.")
    }
    assert set(phase_spans) == {
        f"rollsafe.phase.{p}"
        for p in (
            "open",
            "close_admission",
            "retire_dropped",
            "prepare_envs",
            "drain",
            "cut_generation",
            "commit_envs",
            "capture",
            "resume",
            "publish",
        )
    }
    assert phase_spans["rollsafe.phase.capture"] == {
        "rollsafe.run_id": "traced",
        "rollsafe.checkpoint_id": checkpoint_id_for("traced", 1, "rollout"),
        "rollsafe.seq": 1,
        "rollsafe.phase": "capture",
    }
