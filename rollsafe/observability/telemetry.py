"""Telemetry is installed by entry points only: the CLI, the checkpoint worker, the controller
actor rollsafe starts, and a program that asks for it (:func:`configure_telemetry`). A library
object (a :class:`~rollsafe.checkpoint.controller.Controller` embedded in a trainer, say)
never installs a process-wide provider: a trainer with its own OpenTelemetry setup keeps it,
and rollsafe's instruments record into it."""

from __future__ import annotations

from typing import NamedTuple

from rollsafe.observability.metrics import configure_metrics
from rollsafe.observability.tracing import configure_tracing


class Telemetry(NamedTuple):
    """What :func:`configure_telemetry` installed: True where measurements or spans will go
    somewhere."""

    metrics: bool
    traces: bool


def configure_telemetry() -> Telemetry:
    """Install rollsafe's meter and tracer providers in this process, as the ``OTEL_*``
    environment variables say (docs/operations.md, "Metrics" and "Traces"); once per
    process, a later call changes nothing. A process that installed its own providers first
    keeps them (do not call this there)."""
    return Telemetry(metrics=configure_metrics(), traces=configure_tracing())
