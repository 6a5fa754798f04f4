"""The ten phases of a rollout snapshot (docs/design.md section 5), one module each, named
after its phase; :data:`HANDLERS` maps each :class:`~rollsafe.core.phases.Phase` to its handler,
and the checkpoint activities (rollsafe.activities.snapshot) are registered under the same
names.

:func:`run_once` is the one entry point: the phase ledger answers a repeated call with the
stored result; else :func:`run_handler` runs what every phase shares (the admission lease
checked, resume aside; for a phase that runs while admission is closed, the open draft required
and the lease renewed) and then the phase's handler, between the ``phase.<name>.before`` and
``.after`` fault points.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from rollsafe.checkpoint.outcomes import log_aborted, log_phase, log_phase_failure
from rollsafe.checkpoint.phase_ledger import ABORT
from rollsafe.checkpoint.phases import (
    capture,
    close_admission,
    commit_envs,
    cut_generation,
    drain,
    prepare_envs,
    publish,
    resume,
    retire_dropped,
)
from rollsafe.checkpoint.phases import open as opening
from rollsafe.checkpoint.phases.context import PhaseContext
from rollsafe.core.phases import (
    PHASES,
    Phase,
    PhaseRequest,
    PhaseResult,
    SnapshotSpec,
    holds_admission,
)
from rollsafe.errors import AdmissionLeaseExpired, CheckpointRefused
from rollsafe.faults import fault_point
from rollsafe.observability import metrics

if TYPE_CHECKING:
    from rollsafe.checkpoint.controller import Controller

__all__ = ["HANDLERS", "PhaseContext", "abort_once", "run_once", "take_snapshot"]

Handler = Callable[[PhaseContext], PhaseResult]

HANDLERS: Mapping[Phase, Handler] = MappingProxyType(
    {
        Phase.OPEN: opening.open_draft,
        Phase.CLOSE_ADMISSION: close_admission.close_admission,
        Phase.RETIRE_DROPPED: retire_dropped.retire_dropped,
        Phase.PREPARE_ENVS: prepare_envs.prepare_envs,
        Phase.DRAIN: drain.drain,
        Phase.CUT_GENERATION: cut_generation.cut_generation,
        Phase.COMMIT_ENVS: commit_envs.commit_envs,
        Phase.CAPTURE: capture.capture,
        Phase.RESUME: resume.resume,
        Phase.PUBLISH: publish.publish,
    }
)


def take_snapshot(controller: Controller, spec: SnapshotSpec) -> PhaseResult:
    """Every phase of ``spec``'s snapshot, in order, on ``controller`` (in one process: no
    workflow, no retry): publish's result. For scenario files and tools that want the real
    phases' ordering (capture in the park window, the write after resume, deletions held)
    without Temporal."""
    result = None
    for phase in PHASES:
        result = controller.run_phase(PhaseRequest(spec=spec, phase=phase))
    assert result is not None and result.phase is Phase.PUBLISH
    return result


def run_once(ctx: PhaseContext) -> PhaseResult:
    spec, phase, record = ctx.spec, ctx.phase, ctx.record
    with record.locks[phase]:
        if (stored := ctx.ledger.stored(record, phase)) is not None:
            log_phase(spec, stored, 0.0)
            return stored
        fault_point(f"phase.{phase}.before")
        started = time.monotonic()
        ctx.ledger.begin_phase(record)
        try:
            with metrics.timed_phase(spec.run_id, phase):
                result = run_handler(ctx)
        except Exception as exc:
            log_phase_failure(spec, phase, exc, time.monotonic() - started)
            raise
        finally:
            ctx.ledger.end_phase(record)
        log_phase(spec, result, time.monotonic() - started)
        fault_point(f"phase.{phase}.after")
        record.results[phase] = result
        return result


def abort_once(ctx: PhaseContext) -> PhaseResult:
    """:func:`abort`, once per checkpoint: a repeated call gets the first one's result."""
    record = ctx.record
    with record.locks[ABORT]:
        if record.aborted is not None:
            return record.aborted.model_copy(update={"replayed": True})
        record.aborted = resume.abort(ctx)
        log_aborted(ctx.spec, record.aborted)
        return record.aborted


def run_handler(ctx: PhaseContext) -> PhaseResult:
    if ctx.phase is not Phase.RESUME:
        check_lease(ctx)
    if holds_admission(ctx.phase):
        ctx.drafts.require(ctx.record)
        if not ctx.gate.renew(ctx.checkpoint_id):  # its lease ran out: check_lease said so
            raise CheckpointRefused(
                f"checkpoint {ctx.checkpoint_id}: {ctx.phase.value} runs only while the "
                "checkpoint holds admission closed, and it does not (never closed, or "
                "reopened): what it would capture is not a consistent cut"
            )
    return HANDLERS[ctx.phase](ctx)


def check_lease(ctx: PhaseContext) -> None:
    """Refuse every phase but resume of a checkpoint whose admission lease expired,
    discarding its draft first (it can never be published)."""
    lease_s = ctx.gate.expired(ctx.checkpoint_id)
    if lease_s is None:
        return
    record = ctx.drafts.entry(ctx.checkpoint_id)
    if record is not None:
        ctx.drafts.discard(record, "admission lease expired")
    raise AdmissionLeaseExpired(
        f"checkpoint {ctx.checkpoint_id}: admission stayed closed past its {lease_s:g} s "
        "lease with no phase renewing it (no worker left?) and reopened by itself; the "
        "snapshot is abandoned, nothing of it is published: take the next one"
    )
