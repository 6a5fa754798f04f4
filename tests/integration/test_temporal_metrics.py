"""Temporal's SDK metrics and rollsafe's own reach the same OTLP collector: a worker connected
by ``rollsafe.temporal.connect`` with ``OTEL_METRICS_EXPORTER=otlp`` runs a snapshot, and a
local OTLP/HTTP endpoint receives ``temporal_*`` metrics (Temporal's core, durations in
seconds) beside ``rollsafe.*`` ones (the controller's). In a subprocess: the Temporal runtime
and the meter provider are process-wide, and the variables must be set before either exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from pathlib import Path
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    seen = {}  # metric name -> (unit, resource's telemetry.sdk.language)
    both = threading.Event()

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["content-length"]))
            sent = ExportMetricsServiceRequest.FromString(body)
            for resource in sent.resource_metrics:
                attrs = {a.key: a.value.string_value for a in resource.resource.attributes}
                for scope in resource.scope_metrics:
                    for metric in scope.metrics:
                        seen[metric.name] = (metric.unit, attrs.get("telemetry.sdk.language"),
                                             attrs.get("service.name"), self.path)
            if any(n.startswith("temporal_") for n in seen) and any(
                n.startswith("rollsafe.") for n in seen
            ):
                both.set()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.environ.update({
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
        "OTEL_METRIC_EXPORT_INTERVAL": "200",
        "OTEL_SERVICE_NAME": "rollsafe-metrics-test",
    })

    from rollsafe.activities.controllers import LocalControllerClient
    from rollsafe.checkpoint.controller import Controller
    from rollsafe.core.ids import snapshot_workflow_id, task_queue_for
    from rollsafe.core.phases import SnapshotSpec
    from rollsafe.core.run_state import RunState
    from rollsafe.core.config import RunConfig
    from rollsafe.dataplane import make_dataplane
    from rollsafe.observability.metrics import temporal_runtime
    from rollsafe.snapshot import SnapshotStore
    from rollsafe.temporal.connect import connect
    from rollsafe.temporal.devserver import DevServer
    from rollsafe.workers.checkpoint import build_worker
    from rollsafe.workflows.models import SnapshotInput
    from rollsafe.workflows.snapshot import RolloutSnapshot

    async def main(root: Path) -> None:
        # A program that embeds a controller asks for rollsafe's providers (docs/operations.md,
        # "Traces and metrics"): the controller itself never installs one.
        from rollsafe import configure_telemetry

        assert configure_telemetry().metrics
        async with DevServer(root / "temporal") as dev:
            client = await connect(dev.settings())
            assert client.service_client.config.runtime is temporal_runtime() is not None
            config = RunConfig(run_id="metered", group_size=2, groups_per_step=1)
            ops = Controller.from_parts(
                RunState(config, make_dataplane("memory")), SnapshotStore(root, "metered")
            )
            local = LocalControllerClient(ops)
            async with build_worker(client, task_queue_for("metered"), lambda _: local):
                outcome = await client.execute_workflow(
                    RolloutSnapshot.run,
                    SnapshotInput(spec=SnapshotSpec(run_id="metered", seq=1)),
                    id=snapshot_workflow_id("metered", 1),
                    task_queue=task_queue_for("metered"),
                )
                # Both exporters run every 200 ms: wait for one export of each.
                arrived = await asyncio.to_thread(both.wait, 60)
        print(json.dumps({"status": outcome.status, "arrived": arrived, "seen": seen}))

    asyncio.run(main(Path(sys.argv[1])))
    """
)


def test_temporal_and_rollsafe_metrics_reach_the_same_collector(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    if done.returncode != 0:
        pytest.fail(f"metrics script failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == "published"
    assert result["arrived"], f"only these arrived: {sorted(result['seen'])}"
    seen = {name: tuple(value) for name, value in result["seen"].items()}
    temporal = {name: v for name, v in seen.items() if name.startswith("temporal_")}
    ours = {name: v for name, v in seen.items() if name.startswith("rollsafe.")}
    # Temporal's core (Rust) and rollsafe's exporter (Python), one endpoint, one service name.
    assert {v[1:] for v in temporal.values()} == {("rust", "rollsafe-metrics-test", "/v1/metrics")}
    assert {v[1:] for v in ours.values()} == {("python", "rollsafe-metrics-test", "/v1/metrics")}
    assert "temporal_workflow_completed" in temporal
    latency = temporal["temporal_activity_execution_latency"]
    assert latency[0] == "s"  # durations in seconds, like rollsafe's histograms
    assert "rollsafe.snapshot.park_seconds" in ours
