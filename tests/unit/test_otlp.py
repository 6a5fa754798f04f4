"""The standard OTEL_* variables, each case from a fake environment mapping: which exporter and
protocol each signal gets, what is refused (naming the variable and the allowed values), where
Temporal's SDK metrics go, and a real Temporal runtime exporting to a local collector."""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
    OTLPMetricExporter as GrpcMetricExporter,
)
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from temporalio.runtime import OpenTelemetryMetricTemporality, Runtime, TelemetryConfig

from rollsafe.errors import InvalidInput
from rollsafe.observability import metrics, otlp


@pytest.mark.parametrize(
    ("environ", "spans", "measurements"),
    [
        ({}, type(None), type(None)),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": ""}, type(None), type(None)),
        (
            {"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "Console"},
            ConsoleSpanExporter,
            ConsoleMetricExporter,
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp"},
            OTLPSpanExporter,
            OTLPMetricExporter,
        ),
        (
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            },
            GrpcSpanExporter,
            GrpcMetricExporter,
        ),
        (  # the per-signal protocol wins over the general one
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
            },
            GrpcSpanExporter,
            OTLPMetricExporter,
        ),
        (
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "GRPC",
            },
            GrpcSpanExporter,
            OTLPMetricExporter,
        ),
    ],
)
def test_each_signal_gets_the_exporter_its_variables_name(
    environ: dict[str, str], spans: type, measurements: type
) -> None:
    assert isinstance(otlp.span_exporter(environ), spans)
    assert isinstance(otlp.metric_exporter(environ), measurements)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"OTEL_TRACES_EXPORTER": "jaeger"},
            "OTEL_TRACES_EXPORTER='jaeger': expected one of none, console, otlp",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL='http/json': expected one of http/protobuf, grpc "
            "(no Python exporter speaks http/json)",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "thrift"},
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='thrift': expected one of http/protobuf, grpc",
        ),
    ],
)
def test_a_bad_value_names_the_variable_and_the_allowed_values(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidInput) as error:
        otlp.span_exporter(environ)
    assert str(error.value) == message


def test_a_protocol_is_read_only_for_otlp() -> None:
    """``console`` ignores the protocol: a value meant for another tool is not refused."""
    environ = {"OTEL_METRICS_EXPORTER": "console", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    assert isinstance(otlp.metric_exporter(environ), ConsoleMetricExporter)


@pytest.mark.parametrize("signal", ["traces", "metrics"])
def test_grpc_without_its_package_names_the_package(
    monkeypatch: pytest.MonkeyPatch, signal: str
) -> None:
    kind = "trace" if signal == "traces" else "metric"
    # None in sys.modules makes the import fail as if the package were not installed.
    monkeypatch.setitem(
        sys.modules, f"opentelemetry.exporter.otlp.proto.grpc.{kind}_exporter", None
    )
    environ = {f"OTEL_{signal.upper()}_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    make = otlp.span_exporter if signal == "traces" else otlp.metric_exporter
    with pytest.raises(InvalidInput, match="pip install opentelemetry-exporter-otlp-proto-grpc"):
        make(environ)


@pytest.mark.parametrize(
    ("environ", "endpoint"),
    [
        ({}, "http://localhost:4318/v1/metrics"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"},
            "http://collector:4318/v1/metrics",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://metrics.example/otlp",
            },
            "https://metrics.example/otlp",
        ),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http://localhost:4317"),
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"},
            "http://c:4317",
        ),
    ],
)
def test_the_metrics_endpoint_resolves_as_the_exporter_does(
    environ: dict[str, str], endpoint: str
) -> None:
    assert otlp.metrics_endpoint(environ) == endpoint


def test_the_python_exporter_agrees_on_the_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    exporter = OTLPMetricExporter()
    assert exporter._endpoint == otlp.metrics_endpoint() == "http://collector:4318/v1/metrics"


def test_headers_interval_and_temporality() -> None:
    environ = {
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20general,x-a=1",
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "authorization=Bearer%20metrics",
        "OTEL_METRIC_EXPORT_INTERVAL": "1500",
        "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "DELTA",
    }
    assert otlp.headers("metrics", environ) == {"authorization": "Bearer metrics"}
    assert otlp.headers("traces", environ) == {"authorization": "Bearer general", "x-a": "1"}
    assert otlp.export_interval_s(environ) == 1.5
    assert otlp.export_interval_s({}) == 60.0
    assert otlp.delta_temporality(environ) and not otlp.delta_temporality({})


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "inf"])
def test_a_bad_interval_is_refused(value: str) -> None:
    with pytest.raises(InvalidInput, match="OTEL_METRIC_EXPORT_INTERVAL="):
        otlp.export_interval_s({"OTEL_METRIC_EXPORT_INTERVAL": value})


@pytest.mark.parametrize("exporter", ["console", "otlp"])
@pytest.mark.parametrize("value", ["soon", "0", "inf"])
def test_every_metrics_path_refuses_a_bad_interval_naming_it(
    exporter: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rollsafe's own meter provider and Temporal's runtime read the interval through one
    function: with either exporter both refuse it, naming the variable and its value."""
    environ = {"OTEL_METRICS_EXPORTER": exporter, "OTEL_METRIC_EXPORT_INTERVAL": value}
    named = re.escape(f"OTEL_METRIC_EXPORT_INTERVAL={value!r}: expected milliseconds")
    with pytest.raises(InvalidInput, match=named):
        otlp.metrics_export(environ)
    with pytest.raises(InvalidInput, match=named):
        metrics.temporal_metrics_config(environ)  # a worker's client: Temporal's runtime
    for name, setting in environ.items():
        monkeypatch.setenv(name, setting)
    monkeypatch.setattr(metrics, "_configured", False)  # as in a fresh process
    with pytest.raises(InvalidInput, match=named):
        metrics.configure_metrics()  # a controller: rollsafe's own meter provider
    assert not metrics._configured


def test_the_interval_is_read_once_for_every_exporter() -> None:
    assert otlp.metrics_export({"OTEL_METRIC_EXPORT_INTERVAL": "soon"}) is None  # none: unread
    console = {"OTEL_METRICS_EXPORTER": "console", "OTEL_METRIC_EXPORT_INTERVAL": "250"}
    assert otlp.metrics_export(console) == otlp.MetricsExport(exporter="console", interval_s=0.25)
    assert otlp.metrics_export({"OTEL_METRICS_EXPORTER": "otlp"}) == otlp.MetricsExport(
        exporter="otlp", interval_s=60.0
    )


def test_a_command_with_a_bad_interval_exits_2_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rollsafe inspect` connects as a worker does: the console exporter's bad interval is
    refused before any server is dialled (none listens at the address given)."""
    from typer.testing import CliRunner

    from rollsafe.cli.app import app

    monkeypatch.setattr(metrics, "_runtime_made", False)  # as in a fresh process
    env = {
        "OTEL_METRICS_EXPORTER": "console",
        "OTEL_METRIC_EXPORT_INTERVAL": "soon",
        "TEMPORAL_ADDRESS": "127.0.0.1:1",
        "TEMPORAL_CONFIG_FILE": "/nonexistent/temporal.toml",
        "TEMPORAL_PROFILE": None,
    }
    result = CliRunner().invoke(app, ["inspect", "some-run"], env=env)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "error: OTEL_METRIC_EXPORT_INTERVAL='soon': expected milliseconds, a finite number above 0"
    )


# ---- Temporal's SDK metrics -------------------------------------------------------------


@pytest.mark.parametrize("exporter", [None, "none", "console"])
def test_temporal_keeps_its_default_runtime_unless_otlp(exporter: str | None) -> None:
    environ = {} if exporter is None else {"OTEL_METRICS_EXPORTER": exporter}
    assert metrics.temporal_metrics_config(environ) is None


def test_temporal_metrics_go_where_rollsafes_go() -> None:
    environ = {
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-api-key=secret",
        "OTEL_METRIC_EXPORT_INTERVAL": "5000",
    }
    config = metrics.temporal_metrics_config(environ)
    assert config is not None
    assert config.url == "http://collector:4318/v1/metrics"
    assert config.http is True
    assert config.headers == {"x-api-key": "secret"}
    assert config.metric_periodicity == timedelta(seconds=5)
    assert config.metric_temporality is OpenTelemetryMetricTemporality.CUMULATIVE
    assert config.durations_as_seconds is True

    grpc = metrics.temporal_metrics_config(
        {**environ, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": ""}
    )
    assert grpc is not None and (grpc.url, grpc.http) == ("http://localhost:4317", False)


class Collector:
    """A local OTLP/HTTP metrics endpoint: keeps every request's path, headers and body."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.arrived = threading.Event()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                collector.requests.append((self.path, dict(self.headers), body))
                collector.arrived.set()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def collector() -> Iterator[Collector]:
    found = Collector()
    found.thread.start()
    yield found
    found.server.shutdown()
    found.server.server_close()


def test_a_temporal_runtime_exports_to_the_collector(collector: Collector) -> None:
    """The config drives Temporal's Rust exporter for real: the path, the headers and the
    prefix-free metric made through the runtime's meter arrive at the collector."""
    config = metrics.temporal_metrics_config(
        {
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "x-probe=yes",
            "OTEL_METRIC_EXPORT_INTERVAL": "100",
        }
    )
    assert config is not None
    # Core's own log off: its exporter goes on until exit, warning about the collector gone.
    runtime = Runtime(telemetry=TelemetryConfig(metrics=config, logging=None))
    runtime.metric_meter.create_counter("rollsafe_probe", "a probe", "1").add(3)
    assert collector.arrived.wait(30), "no export reached the collector"
    path, headers, body = collector.requests[-1]
    assert path == "/v1/metrics"
    assert headers.get("x-probe") == "yes"
    sent = ExportMetricsServiceRequest.FromString(body)
    names = {
        metric.name
        for resource in sent.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    assert "rollsafe_probe" in names


def test_one_runtime_per_process_made_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[TelemetryConfig] = []

    class FakeRuntime:
        def __init__(self, telemetry: TelemetryConfig) -> None:
            made.append(telemetry)

    monkeypatch.setattr("temporalio.runtime.Runtime", FakeRuntime)
    monkeypatch.setattr(metrics, "_runtime", None)
    monkeypatch.setattr(metrics, "_runtime_made", False)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    first = metrics.temporal_runtime()
    assert metrics.temporal_runtime() is first and isinstance(first, FakeRuntime)
    [telemetry] = made
    assert telemetry.metric_prefix == metrics.TEMPORAL_PREFIX

    monkeypatch.setattr(metrics, "_runtime", None)
    monkeypatch.setattr(metrics, "_runtime_made", False)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    assert metrics.temporal_runtime() is None
    assert len(made) == 1
