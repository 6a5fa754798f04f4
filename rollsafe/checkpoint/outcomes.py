"""The controller's log lines (docs/operations.md, "Logs"): one per phase outcome, one per
restore, each failure with its error's class. Each line carries its fields in ``extra`` too, so
the JSON format has them as fields. Logged as ``rollsafe.checkpoint.controller``: the
controller is what an operator filters on."""

from __future__ import annotations

import logging

from rollsafe.core.gate import GateChange
from rollsafe.core.phases import Phase, PhaseResult, RestorePlan, RestoreRequest, SnapshotSpec
from rollsafe.errors import RollsafeError
from rollsafe.observability import metrics

log = logging.getLogger("rollsafe.checkpoint.controller")


def _fields(spec: SnapshotSpec, **more: object) -> dict[str, object]:
    return {"run_id": spec.run_id, "checkpoint_id": spec.checkpoint_id, **more}


def log_phase(spec: SnapshotSpec, result: PhaseResult, seconds: float) -> None:
    """A phase done (``replayed``: its stored result answered a repeated call). DEBUG: the
    phase's activity logs the same outcome at INFO where the workflow runs."""
    how = "replayed (the stored result of an earlier call)" if result.replayed else "done"
    log.debug(
        "run %s checkpoint %s phase %s %s in %.3f s: %s",
        spec.run_id,
        spec.checkpoint_id,
        result.phase.value,
        how,
        seconds,
        result.summary,
        extra=_fields(
            spec, phase=result.phase.value, replayed=result.replayed, seconds=round(seconds, 6)
        ),
    )


def log_aborted(spec: SnapshotSpec, result: PhaseResult) -> None:
    log.info(
        "run %s checkpoint %s %s",
        spec.run_id,
        spec.checkpoint_id,
        result.summary,
        extra=_fields(spec, phase="abort"),
    )


def log_lease_expired(run_id: str, checkpoint_id: str, change: GateChange) -> None:
    """The admission gate's hook (called once its lock is released): the park window ended
    by the lease."""
    metrics.admission_reopened(run_id, change)
    log.warning(
        "run %s: checkpoint %s held admission closed past its lease; admission reopened "
        "by itself and the snapshot is abandoned",
        run_id,
        checkpoint_id,
        extra={"run_id": run_id, "checkpoint_id": checkpoint_id},
    )


def _failure_level(error: BaseException) -> tuple[int, bool]:
    """INFO for an outcome the design expects, WARNING for an error a later try may not meet
    (transient), ERROR otherwise."""
    if not isinstance(error, RollsafeError):
        return logging.ERROR, False
    if error.expected:
        return logging.INFO, error.transient
    return (logging.WARNING if error.transient else logging.ERROR), error.transient


def log_phase_failure(spec: SnapshotSpec, phase: Phase, error: Exception, seconds: float) -> None:
    level, transient = _failure_level(error)
    log.log(
        level,
        "run %s checkpoint %s phase %s failed after %.3f s: %s: %s",
        spec.run_id,
        spec.checkpoint_id,
        phase.value,
        seconds,
        type(error).__name__,
        error,
        extra=_fields(
            spec,
            phase=phase.value,
            replayed=False,
            seconds=round(seconds, 6),
            error_type=type(error).__name__,
            transient=transient,
        ),
        exc_info=not isinstance(error, RollsafeError),  # not ours: a bug, keep its traceback
    )


def log_restore(request: RestoreRequest, plan: RestorePlan, seconds: float) -> None:
    counts = {
        "ready_groups": len(plan.ready),
        "partial_groups": len(plan.partial),
        "released_claims": len(plan.released_claims),
        "redispatch": len(plan.redispatch),
        "refused_snapshots": len(plan.skipped),
        "environments_failed": len(plan.environments_failed),
        "environments_lost": len(plan.environments_lost),
        "journal_records": plan.journal.records if plan.journal else 0,
    }
    log.info(
        "run %s restore %s: restored %s (checkpoint %s, weight version %d, loader position %d) "
        "in %.3f s: %s",
        request.run_id,
        request.restore_id,
        plan.snapshot,
        plan.checkpoint_id,
        plan.weight_version,
        plan.loader_position,
        seconds,
        ", ".join(f"{value} {key.replace('_', ' ')}" for key, value in counts.items()),
        extra={
            "run_id": request.run_id,
            "restore_id": request.restore_id,
            "snapshot": plan.snapshot,
            "checkpoint_id": plan.checkpoint_id,
            "seconds": round(seconds, 6),
            **counts,
        },
    )
    if plan.journal is not None and plan.journal.stop is not None:
        log.warning(
            "run %s restore %s: the journal stopped at %s; nothing after it was applied",
            request.run_id,
            request.restore_id,
            plan.journal.stop,
            extra={"run_id": request.run_id, "restore_id": request.restore_id},
        )
    for instance, why in sorted(plan.environments_failed.items()):
        log.warning(
            "run %s restore %s: instance %s could not restore its episodes (they restart): %s",
            request.run_id,
            request.restore_id,
            instance,
            why,
            extra={"run_id": request.run_id, "restore_id": request.restore_id},
        )


def log_restore_failure(request: RestoreRequest, error: Exception, seconds: float) -> None:
    level, transient = _failure_level(error)
    log.log(
        level,
        "run %s restore %s failed after %.3f s: %s: %s",
        request.run_id,
        request.restore_id,
        seconds,
        type(error).__name__,
        error,
        extra={
            "run_id": request.run_id,
            "restore_id": request.restore_id,
            "seconds": round(seconds, 6),
            "error_type": type(error).__name__,
            "transient": transient,
        },
        exc_info=not isinstance(error, RollsafeError),
    )
