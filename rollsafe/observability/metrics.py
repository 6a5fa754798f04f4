"""OpenTelemetry metrics of checkpointing: how long admission stays parked, how long the drain
takes, what the generation cut did, how many bytes a snapshot wrote, and what a restore reused.

``OTEL_METRICS_EXPORTER`` picks the exporter, like ``OTEL_TRACES_EXPORTER`` for tracing
(:mod:`rollsafe.observability.tracing`): ``none`` (the default: recording is the API's no-op
until asked for), ``console``, or ``otlp`` (``http/protobuf`` or ``grpc``, endpoint and headers
from the standard ``OTEL_EXPORTER_OTLP_*`` variables: :mod:`rollsafe.observability.otlp`).
Export is periodic (``OTEL_METRIC_EXPORT_INTERVAL``, default 60 s) and flushed when the process
exits.

Temporal's own SDK metrics (``temporal_*``: polls, task latencies, slots, requests) go to the
same collector when the exporter is ``otlp``: :func:`temporal_runtime` is the Temporal
``Runtime`` every client of this process is connected with
(:func:`rollsafe.temporal.connect.connect`), and workers built from a client inherit it.

Every instrument is recorded where :class:`~rollsafe.checkpoint.controller.Controller` runs (the
controller's process: the Ray actor, or a worker's local controller), which is why the
controller configures metrics when it is built. Every measurement carries ``rollsafe.run_id``.

Cut outcomes (``rollsafe.snapshot.cuts``, attribute ``outcome``), from the engines' refusal
reasons (:data:`rollsafe.engine.protocol.RefusalReason`):

- ``cut``: the call was frozen and its prefix staged;
- ``skipped``: not cut on purpose (the episode's group restores at a coarser level than
  ``prefix``: the prefix would never be used), ``finished`` / ``abandoned`` (the call ended),
  ``not_admitted`` / ``unknown_call`` (no engine holds it yet) or ``no_tokens`` (started, no
  token yet): restarting the turn loses no generated token;
- ``failed``: any other reason (``constrained_decoding``: tokens were generated but cannot be
  cut, so they are generated again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

from opentelemetry import metrics

from rollsafe.core.phases import Phase, RestorePlan
from rollsafe.observability import otlp

if TYPE_CHECKING:  # the SDK is imported only when metrics are configured
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader
    from temporalio.runtime import OpenTelemetryConfig, Runtime

    from rollsafe.core.gate import GateChange
    from rollsafe.engine.staging import StagedCut
    from rollsafe.snapshot import SnapshotManifest

EXPORTER_ENV = otlp.exporter_variable("metrics")
CHOICES = otlp.EXPORTERS
# Temporal's metric names start with this (its own default, spelled out: the docs name it).
TEMPORAL_PREFIX = "temporal_"
RUN_ID = "rollsafe.run_id"
SKIPPED_REFUSALS = frozenset({"finished", "abandoned", "not_admitted", "unknown_call", "no_tokens"})
# Seconds, from a millisecond gate flip to a drain that hits its timeout: the SDK's default
# buckets are sized for milliseconds and would put every park in the first few.
SECONDS_BUCKETS: tuple[float, ...] = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)

_lock = threading.Lock()
_configured = False

# Instruments from the API's global meter: no-ops until a provider is installed, then they
# delegate to it (instruments made before the provider are proxies that pick it up).
_meter = metrics.get_meter("rollsafe")
PARK = _meter.create_histogram(
    "rollsafe.snapshot.park_seconds",
    unit="s",
    description="admission closed -> reopened, per checkpoint",
    explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
)
DRAIN = _meter.create_histogram(
    "rollsafe.snapshot.drain_seconds",
    unit="s",
    description="duration of the drain phase",
    explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
)
CUTS = _meter.create_counter(
    "rollsafe.snapshot.cuts",
    unit="{call}",
    description="generation calls at the cut, by outcome (cut, skipped, failed)",
)
CAPTURE_BYTES = _meter.create_counter(
    "rollsafe.snapshot.capture_bytes",
    unit="By",
    description="bytes of the files a published snapshot holds (manifest excluded)",
)
RESTORE_ROLLOUTS = _meter.create_counter(
    "rollsafe.restore.rollouts",
    unit="{rollout}",
    description="rollouts of a restored run, by kind (reused, resumed, rerun)",
)
PREFIX_TOKENS = _meter.create_counter(
    "rollsafe.restore.prefix_tokens",
    unit="{token}",
    description="generated tokens restored as staged prefixes instead of generated again",
)


def exporter_from_env(environ: Mapping[str, str] | None = None) -> MetricExporter | None:
    """The exporter ``OTEL_METRICS_EXPORTER`` names (None for ``none``)."""
    return otlp.metric_exporter(environ)


def configure_metrics(reader: MetricReader | None = None) -> bool:
    """Install the meter provider once per process; True when measurements will go somewhere.

    ``reader`` (tests: an ``InMemoryMetricReader``) takes precedence over the environment.
    A second call, with or without a reader, changes nothing: OpenTelemetry allows one global
    provider per process."""
    global _configured
    with _lock:
        if _configured:
            return True
        if reader is None:
            export = otlp.metrics_export()  # checked as Temporal's runtime checks it
            exporter = exporter_from_env()
            if export is None or exporter is None:
                return False
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            # The interval read here, not by the reader: Temporal's runtime uses the same one.
            interval_ms = export.interval_s * 1000
            reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms)
        from opentelemetry.sdk.metrics import MeterProvider

        # The SDK's default resource: OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES.
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        _configured = True
        return True


# ---- Temporal's SDK metrics -------------------------------------------------------------

_runtime_lock = threading.Lock()
_runtime: Runtime | None = None
_runtime_made = False


def temporal_metrics_config(
    environ: Mapping[str, str] | None = None,
) -> OpenTelemetryConfig | None:
    """Where Temporal's core exports its metrics: the collector rollsafe's own metrics go to
    (endpoint, protocol, headers, interval, temporality read as the Python exporter reads
    them); None unless ``OTEL_METRICS_EXPORTER=otlp`` (``console`` has no Temporal
    counterpart, but its interval is checked all the same). Durations are exported in
    seconds, like rollsafe's histograms."""
    export = otlp.metrics_export(environ)  # checked as rollsafe's own provider checks it
    if export is None or export.exporter != "otlp":
        return None
    from temporalio.runtime import OpenTelemetryConfig, OpenTelemetryMetricTemporality

    temporality = (
        OpenTelemetryMetricTemporality.DELTA
        if otlp.delta_temporality(environ)
        else OpenTelemetryMetricTemporality.CUMULATIVE
    )
    return OpenTelemetryConfig(
        url=otlp.metrics_endpoint(environ),
        headers=otlp.headers("metrics", environ),
        metric_periodicity=timedelta(seconds=export.interval_s),
        metric_temporality=temporality,
        durations_as_seconds=True,
        http=otlp.protocol("metrics", environ) == otlp.HTTP_PROTOBUF,
    )


def temporal_runtime() -> Runtime | None:
    """The Temporal ``Runtime`` this process's clients use: one, made on first use and kept
    (each Runtime is a thread pool of its own, and its exporter would count from zero again),
    exporting to the OTLP collector; None, Temporal's default runtime, unless
    ``OTEL_METRICS_EXPORTER=otlp``. Its resource (``service.name``, attributes) comes from
    ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``, read by Temporal's core itself."""
    global _runtime, _runtime_made
    with _runtime_lock:
        if not _runtime_made:
            config = temporal_metrics_config()
            if config is not None:
                from temporalio.runtime import Runtime, TelemetryConfig

                telemetry = TelemetryConfig(metrics=config, metric_prefix=TEMPORAL_PREFIX)
                _runtime = Runtime(telemetry=telemetry)
            _runtime_made = True
        return _runtime


# ---- recording (called by the controller) -----------------------------------------------


def admission_reopened(run_id: str, change: GateChange) -> None:
    """The park window ended (resume, abort or its lease): record how long it lasted, by the
    gate's own clock; nothing when the gate did not really reopen here."""
    if change.changed and change.held_s is not None:
        record_park(run_id, change.held_s)


def record_park(run_id: str, seconds: float) -> None:
    PARK.record(seconds, {RUN_ID: run_id})


@contextmanager
def timed_phase(run_id: str, phase: Phase) -> Iterator[None]:
    """Time a phase that runs (not a replayed result); the drain's duration is recorded when
    it succeeds. Other phases pass through untimed."""
    started = time.monotonic()
    yield
    if phase is Phase.DRAIN:
        DRAIN.record(time.monotonic() - started, {RUN_ID: run_id})


def cut_outcomes(cut: StagedCut) -> dict[str, int]:
    """Calls per outcome (``cut``, ``skipped``, ``failed``): the mapping in the module doc."""
    outcomes = {"cut": len(cut.staged), "skipped": len(cut.skipped), "failed": 0}
    for refusal in cut.refused:
        outcomes["skipped" if refusal.reason in SKIPPED_REFUSALS else "failed"] += 1
    return outcomes


def record_cut(run_id: str, cut: StagedCut) -> None:
    for outcome, count in cut_outcomes(cut).items():
        CUTS.add(count, {RUN_ID: run_id, "outcome": outcome})


def record_capture_bytes(run_id: str, manifest: SnapshotManifest) -> None:
    """A new publish: the bytes of every file it holds (what capture and commit wrote)."""
    CAPTURE_BYTES.add(sum(entry.bytes for entry in manifest.files.values()), {RUN_ID: run_id})


def restore_counts(plan: RestorePlan, group_size: int) -> dict[str, int]:
    """Rollouts per kind: ready groups and sealed siblings are reused, attempts restored by
    their environment are resumed, the rest run again."""
    partial = plan.partial.values()
    return {
        "reused": group_size * len(plan.ready) + sum(len(p.restored) for p in partial),
        "resumed": sum(len(p.resumed) for p in partial),
        "rerun": sum(len(p.regenerate) for p in partial),
    }


def record_restore(run_id: str, plan: RestorePlan, group_size: int) -> None:
    for kind, count in restore_counts(plan, group_size).items():
        RESTORE_ROLLOUTS.add(count, {RUN_ID: run_id, "kind": kind})


def record_restored_prefix_tokens(run_id: str, n: int) -> None:
    """Tokens of staged prefixes a restore handed back to their calls."""
    PREFIX_TOKENS.add(n, {RUN_ID: run_id})
