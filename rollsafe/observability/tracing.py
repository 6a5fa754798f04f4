"""OpenTelemetry tracing: spans per workflow, activity and phase, exported where the standard
OTel environment says.

``OTEL_TRACES_EXPORTER`` picks the exporter: ``none`` (the default here: tracing costs nothing
until asked for), ``console``, or ``otlp`` (``http/protobuf`` or ``grpc`` as
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` say; endpoint and
headers from the standard ``OTEL_EXPORTER_OTLP_*`` variables): :mod:`rollsafe.observability.otlp`.
Workflow and activity spans come from Temporal's contrib plugin on the client (workers built
from that client inherit it); each phase adds a ``rollsafe.phase`` span with run, snapshot and
phase attributes; the environment and engine servers add a server span per request, a child of
the caller's (:mod:`rollsafe.http.tracing`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.util.types import AttributeValue

from rollsafe.observability.otlp import exporter_variable, span_exporter

EXPORTER_ENV = exporter_variable("traces")
_lock = threading.Lock()
_configured = False


def configure_tracing(processor: SpanProcessor | None = None) -> bool:
    """Install the tracer provider once per process; True when spans will go somewhere.

    ``processor`` (tests: an in-memory exporter) takes precedence over the environment."""
    global _configured
    with _lock:
        if _configured:
            return True
        if processor is None:
            exporter = span_exporter()
            if exporter is None:
                return False
            processor = BatchSpanProcessor(exporter)
        from temporalio.contrib.opentelemetry import create_tracer_provider

        # Replay-safe: no duplicate spans on replay. Its resource is the SDK's default one
        # (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES).
        provider = create_tracer_provider()
        provider.add_span_processor(processor)
        trace.set_tracer_provider(provider)
        _configured = True
        return True


def client_plugins() -> list[Any]:
    """Temporal client plugins: Temporal's tracing plugin when this process has a tracer
    provider (rollsafe's, which an entry point installed: :func:`configure_tracing`; or the
    process's own), nothing otherwise. Never installs one: connecting a client is no entry
    point, and a trainer that installs its own provider later must get it."""
    with _lock:
        ours = _configured
    if not ours and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return []
    from temporalio.contrib.opentelemetry import OpenTelemetryPlugin

    return [OpenTelemetryPlugin(add_temporal_spans=True)]


@contextmanager
def phase_span(run_id: str, checkpoint_id: str, seq: int, phase: str) -> Iterator[None]:
    tracer = trace.get_tracer("rollsafe")
    attributes: dict[str, AttributeValue] = {
        "rollsafe.run_id": run_id,
        "rollsafe.checkpoint_id": checkpoint_id,
        "rollsafe.seq": seq,
        "rollsafe.phase": phase,
    }
    with tracer.start_as_current_span(f"rollsafe.phase.{phase}", attributes=attributes):
        yield
