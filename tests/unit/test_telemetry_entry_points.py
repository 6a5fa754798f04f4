"""Telemetry is installed by entry points only (rollsafe.observability.telemetry): a trainer
that embeds a controller keeps its own OpenTelemetry providers, and rollsafe's instruments
record into them. Each check runs in a fresh interpreter: a global provider, once set, stays."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CONSOLE = {"OTEL_METRICS_EXPORTER": "console", "OTEL_TRACES_EXPORTER": "console"}

EMBEDDED = """
import tempfile
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from rollsafe import Controller, RunConfig
from rollsafe.core.phases import Phase, PhaseRequest, SnapshotSpec

config = RunConfig(run_id="embedded", group_size=1, groups_per_step=1)
controller = Controller(config, tempfile.mkdtemp())
mine = InMemoryMetricReader()  # the trainer's own, installed after it made its controller
metrics.set_meter_provider(MeterProvider(metric_readers=[mine]))
spec = SnapshotSpec(run_id="embedded", seq=1)
for phase in Phase:
    controller.run_phase(PhaseRequest(spec=spec, phase=phase))
names = {m.name for rm in mine.get_metrics_data().resource_metrics
         for sm in rm.scope_metrics for m in sm.metrics}
print(sorted(names))
assert "rollsafe.snapshot.park_seconds" in names, names
"""

CONNECTING = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from rollsafe.observability.tracing import client_plugins
print(len(client_plugins()))  # what connect() asks for: the trainer has no provider yet
mine = TracerProvider()
trace.set_tracer_provider(mine)  # the trainer's own, installed after it connected
assert trace.get_tracer_provider() is mine, type(trace.get_tracer_provider())
print(len(client_plugins()))  # now there is one to trace into: Temporal's plugin
"""

ENTRY_POINT = """
from opentelemetry import metrics, trace
import rollsafe
print(rollsafe.configure_telemetry())
print(type(metrics.get_meter_provider()).__module__, type(trace.get_tracer_provider()).__module__)
"""


def run(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **CONSOLE}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def test_an_embedded_controller_records_into_the_trainers_own_provider(tmp_path: Path) -> None:
    done = run(EMBEDDED, tmp_path)
    assert done.returncode == 0, done.stderr
    # Had the controller installed rollsafe's console provider, the trainer's could not be
    # installed (OpenTelemetry keeps the first provider set): nothing would reach its reader.
    assert "park_seconds" in done.stdout and '"resource_metrics"' not in done.stdout


def test_connecting_a_client_installs_no_tracer_provider(tmp_path: Path) -> None:
    """A client connected before the trainer set its own tracer provider installs none
    (it used to install rollsafe's, and the trainer's was then refused); once the process has
    one, the client traces into it."""
    done = run(CONNECTING, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1"]


def test_configure_telemetry_installs_both_providers_from_the_environment(tmp_path: Path) -> None:
    done = run(ENTRY_POINT, tmp_path)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()[:2]
    assert first == "Telemetry(metrics=True, traces=True)"
    meters, tracers = second.split()
    assert meters.startswith("opentelemetry.sdk.metrics")
    assert tracers.startswith("temporalio.contrib.opentelemetry")  # replay-safe spans
