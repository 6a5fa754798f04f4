"""The standard ``OTEL_*`` variables, read once for every signal rollsafe exports.

Per signal (``traces``, ``metrics``):

- ``OTEL_{SIGNAL}_EXPORTER``: ``none`` (the default: exporting costs nothing until asked for),
  ``console`` or ``otlp``;
- ``OTEL_EXPORTER_OTLP_{SIGNAL}_PROTOCOL``, else ``OTEL_EXPORTER_OTLP_PROTOCOL``:
  ``http/protobuf`` (the default, the HTTP exporter rollsafe depends on) or ``grpc`` (needs
  ``opentelemetry-exporter-otlp-proto-grpc``); ``http/json`` has no Python exporter;
- endpoint, headers, timeout, compression and certificates: the exporter reads its own
  ``OTEL_EXPORTER_OTLP_*`` variables, so they mean exactly what OpenTelemetry documents;
- ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``: the SDK's default ``Resource``.

Temporal's SDK metrics are exported by its Rust core, which reads none of the exporter's
variables: :func:`metrics_endpoint`, :func:`headers` and :func:`export_interval_s` resolve them
as the Python exporter does, for :func:`rollsafe.observability.metrics.temporal_runtime`.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Literal, cast

from pydantic import BaseModel, ConfigDict

from rollsafe.errors import InvalidInput

if TYPE_CHECKING:  # the SDK and the exporters are imported only for the exporter asked for
    from opentelemetry.sdk.metrics.export import MetricExporter
    from opentelemetry.sdk.trace.export import SpanExporter

Signal = Literal["traces", "metrics"]
EXPORTERS = ("none", "console", "otlp")
HTTP_PROTOBUF, GRPC = "http/protobuf", "grpc"
PROTOCOLS = (HTTP_PROTOBUF, GRPC)
GRPC_PACKAGE = "opentelemetry-exporter-otlp-proto-grpc"
# OpenTelemetry's defaults (the exporters' own, and the specification's).
HTTP_ENDPOINT = "http://localhost:4318"
GRPC_ENDPOINT = "http://localhost:4317"
INTERVAL_ENV = "OTEL_METRIC_EXPORT_INTERVAL"
DEFAULT_INTERVAL_MS = 60_000.0
TEMPORALITY_ENV = "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def exporter_variable(signal: Signal) -> str:
    return f"OTEL_{signal.upper()}_EXPORTER"


def exporter_name(signal: Signal, environ: Mapping[str, str] | None = None) -> str:
    """``OTEL_{SIGNAL}_EXPORTER``, checked: ``none``, ``console`` or ``otlp``."""
    variable = exporter_variable(signal)
    name = _env(environ).get(variable, "none").strip().lower() or "none"
    if name not in EXPORTERS:
        raise InvalidInput(f"{variable}={name!r}: expected one of {', '.join(EXPORTERS)}")
    return name


def protocol(signal: Signal, environ: Mapping[str, str] | None = None) -> str:
    """The OTLP protocol of ``signal``: its own variable, else the general one, else
    ``http/protobuf``."""
    env = _env(environ)
    own = f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL"
    for variable in (own, "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = env.get(variable, "").strip().lower()
        if not value:
            continue
        if value not in PROTOCOLS:
            raise InvalidInput(
                f"{variable}={value!r}: expected one of {', '.join(PROTOCOLS)}"
                + (" (no Python exporter speaks http/json)" if value == "http/json" else "")
            )
        return value
    return HTTP_PROTOBUF


def span_exporter(environ: Mapping[str, str] | None = None) -> SpanExporter | None:
    """The span exporter the variables name (None for ``none``)."""
    name = exporter_name("traces", environ)
    if name == "none":
        return None
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if protocol("traces", environ) == GRPC:
        return cast("SpanExporter", _grpc_module("trace").OTLPSpanExporter())
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def metric_exporter(environ: Mapping[str, str] | None = None) -> MetricExporter | None:
    """The metric exporter the variables name (None for ``none``)."""
    name = exporter_name("metrics", environ)
    if name == "none":
        return None
    if name == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return ConsoleMetricExporter()
    if protocol("metrics", environ) == GRPC:
        return cast("MetricExporter", _grpc_module("metric").OTLPMetricExporter())
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter()


def _grpc_module(kind: Literal["trace", "metric"]) -> ModuleType:
    """The grpc exporter's module: an optional package, named when it is missing."""
    try:
        return importlib.import_module(f"opentelemetry.exporter.otlp.proto.grpc.{kind}_exporter")
    except ImportError as exc:
        raise InvalidInput(
            f"OTLP {kind}s over grpc need the grpc exporter: pip install {GRPC_PACKAGE}, or "
            f"export over HTTP (OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf) ({exc})"
        ) from None


def metrics_endpoint(environ: Mapping[str, str] | None = None) -> str:
    """Where OTLP metrics go, as the Python exporters resolve it: the per-signal variable as
    it is; else the general endpoint (plus ``/v1/metrics`` over HTTP); else the default."""
    env = _env(environ)
    if endpoint := env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "").strip():
        return endpoint
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if protocol("metrics", env) == GRPC:
        return base or GRPC_ENDPOINT
    return f"{(base or HTTP_ENDPOINT).removesuffix('/')}/v1/metrics"


def headers(signal: Signal, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``OTEL_EXPORTER_OTLP_{SIGNAL}_HEADERS``, else ``OTEL_EXPORTER_OTLP_HEADERS``
    (``key=value,...``, URL-encoded), parsed by the SDK's own parser. They may hold
    credentials: never log them."""
    from opentelemetry.util.re import parse_env_headers

    env = _env(environ)
    raw = env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_HEADERS") or env.get(
        "OTEL_EXPORTER_OTLP_HEADERS", ""
    )
    return dict(parse_env_headers(raw, liberal=True))


def export_interval_s(environ: Mapping[str, str] | None = None) -> float:
    """``OTEL_METRIC_EXPORT_INTERVAL`` (milliseconds, default 60000), in seconds."""
    raw = _env(environ).get(INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_MS / 1000
    try:
        millis = float(raw)
    except ValueError:
        millis = -1.0
    if not (millis > 0 and math.isfinite(millis)):
        raise InvalidInput(
            f"{INTERVAL_ENV}={raw!r}: expected milliseconds, a finite number above 0"
        )
    return millis / 1000


class MetricsExport(BaseModel):
    """Where metrics go and how often, as the ``OTEL_*`` variables say."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    exporter: Literal["console", "otlp"]
    interval_s: float


def metrics_export(environ: Mapping[str, str] | None = None) -> MetricsExport | None:
    """``OTEL_METRICS_EXPORTER`` and ``OTEL_METRIC_EXPORT_INTERVAL``, checked together: the
    one reading of them that every metrics path uses (rollsafe's own meter provider, Temporal's
    runtime), so a bad interval is refused whichever exporter reads it. None for ``none``
    (nothing is exported, so nothing reads the interval)."""
    name = exporter_name("metrics", environ)
    if name == "none":
        return None
    exporter: Literal["console", "otlp"] = "console" if name == "console" else "otlp"
    return MetricsExport(exporter=exporter, interval_s=export_interval_s(environ))


def delta_temporality(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE`` asks for ``delta``
    (anything else: cumulative, the default)."""
    return _env(environ).get(TEMPORALITY_ENV, "").strip().lower() == "delta"
