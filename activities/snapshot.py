"""One activity per snapshot phase, each a thin call to the run's controller.

Activities are registered under the phase's name (built in a loop by
``SnapshotActivities._phase_activity``: search for ``Phase.CAPTURE``, not ``def capture``), so
an operator sees the phase of a stuck snapshot as its pending activity. A run without
participants has phases 3-7 run as local activities (no work of their own).

Long calls heartbeat every second (docs/design.md section 5: heartbeat timeout ~5 s) so a
killed worker's phase is retried within seconds, and a cancelled phase (abort) is noticed at
the next beat. A phase that runs while its checkpoint holds admission closed also renews the
admission lease with every beat: a worker that dies stops renewing, and the gate reopens by
itself once the lease runs out (rollsafe.core.gate).

Each phase activity logs its outcome on ``temporalio.activity.logger`` (the activity's
workflow id, attempt and task queue ride along in ``temporal_activity``): one INFO line when
it is done (phase, checkpoint, replayed or not, seconds), one WARNING line when it fails (the
error type, and whether a retry may help): INFO, and no traceback from the SDK either, for the
outcomes the design expects (``RollsafeError.expected``: an anchor passed, a controller
awaiting its restore).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from rollsafe.activities.controllers import ControllerResolver
from rollsafe.activities.errors import to_application_error
from rollsafe.core.phases import (
    PHASES,
    Phase,
    PhaseRequest,
    PhaseResult,
    RestorePlan,
    RestoreRequest,
    SnapshotSpec,
    holds_admission,
)
from rollsafe.errors import RollsafeError
from rollsafe.faults import fault_point, register
from rollsafe.observability.tracing import phase_span
from rollsafe.workflows.restore import RESTORE_CONTROLLER_ACTIVITY
from rollsafe.workflows.snapshot import ABORT_ACTIVITY
from rollsafe.workflows.supervisor import NEXT_SEQ_ACTIVITY

HEARTBEAT_EVERY_S = 1.0
# In the worker process, around the controller call: "after" is the window where the phase
# is done but Temporal has not recorded it (kill the worker there: the retry must replay).
WORKER_POINTS = register(
    *(f"worker.phase.{phase.value}.{when}" for phase in PHASES for when in ("before", "after"))
)
T = TypeVar("T")
Beat = Callable[[], Awaitable[object]]


async def _heartbeating(call: Awaitable[T], detail: str, on_beat: Beat | None = None) -> T:
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=HEARTBEAT_EVERY_S)
            if done:
                return task.result()
            if not activity.info().is_local:  # a local activity's worker keeps its task alive
                activity.heartbeat(detail)
            if on_beat is not None:
                await _beat(on_beat, detail)
    except RollsafeError as exc:
        raise to_application_error(exc) from exc
    except asyncio.CancelledError:
        task.cancel()
        raise


async def _beat(on_beat: Beat, detail: str) -> None:
    """A renewal that fails is not the phase's failure: the next beat tries again, and a lease
    that runs out only abandons the snapshot."""
    try:
        await asyncio.wait_for(on_beat(), HEARTBEAT_EVERY_S)
    except (RollsafeError, TimeoutError) as exc:
        activity.logger.warning(  # the type too: a TimeoutError's message is empty
            "%s: renewing the admission lease failed (%s: %s)", detail, type(exc).__name__, exc
        )


def _failure(error: BaseException) -> tuple[str, bool]:
    """The error's type as Temporal records it, and whether Temporal retries it: a rollsafe
    error arrives here as an ApplicationError named after its class (invariant errors are
    non-retryable); anything else is retried."""
    if isinstance(error, ApplicationError):
        return error.type or "ApplicationError", not error.non_retryable
    return type(error).__name__, True


def log_phase_done(spec: SnapshotSpec, result: PhaseResult, seconds: float) -> None:
    activity.logger.info(
        "phase %s of %s %s in %.3f s: %s",
        result.phase.value,
        spec.checkpoint_id,
        "replayed (stored result)" if result.replayed else "done",
        seconds,
        result.summary,
        extra={
            "run_id": spec.run_id,
            "checkpoint_id": spec.checkpoint_id,
            "phase": result.phase.value,
            "replayed": result.replayed,
            "seconds": round(seconds, 6),
        },
    )


def log_phase_failed(
    spec: SnapshotSpec, phase: Phase, error: BaseException, seconds: float
) -> None:
    error_type, transient = _failure(error)
    expected = (
        isinstance(error, ApplicationError) and error.category == ApplicationErrorCategory.BENIGN
    )
    log = activity.logger.info if expected else activity.logger.warning
    log(
        "phase %s of %s failed after %.3f s (%s): %s: %s",
        phase.value,
        spec.checkpoint_id,
        seconds,
        "transient: Temporal retries it" if transient else "not transient: not retried",
        error_type,
        error,
        extra={
            "run_id": spec.run_id,
            "checkpoint_id": spec.checkpoint_id,
            "phase": phase.value,
            "replayed": False,
            "seconds": round(seconds, 6),
            "error_type": error_type,
            "transient": transient,
        },
    )


class SnapshotActivities:
    def __init__(self, resolve: ControllerResolver) -> None:
        self._resolve = resolve

    def _phase_activity(self, phase: Phase) -> Callable[[PhaseRequest], Awaitable[PhaseResult]]:
        async def run(request: PhaseRequest) -> PhaseResult:
            if request.phase != phase:
                raise ValueError(f"activity {phase.value} got a request for {request.phase}")
            controller = self._resolve(request.spec.run_id)
            spec = request.spec
            renew = (lambda: controller.renew_admission(spec)) if holds_admission(phase) else None
            started = time.monotonic()
            try:
                with phase_span(spec.run_id, spec.checkpoint_id, spec.seq, phase.value):
                    fault_point(f"worker.phase.{phase.value}.before")
                    call = controller.run_phase(request)
                    result = await _heartbeating(call, phase.value, renew)
                    fault_point(f"worker.phase.{phase.value}.after")
            except Exception as exc:  # a cancellation (abort) is not a failure: not logged
                log_phase_failed(spec, phase, exc, time.monotonic() - started)
                raise
            log_phase_done(spec, result, time.monotonic() - started)
            return result

        run.__name__ = f"phase_{phase.value}"
        return activity.defn(name=phase.value)(run)

    def all(self) -> list[Callable[..., Any]]:
        resolve = self._resolve

        @activity.defn(name=ABORT_ACTIVITY)
        async def abort_snapshot(spec: SnapshotSpec) -> PhaseResult:
            result = await _heartbeating(resolve(spec.run_id).abort(spec), ABORT_ACTIVITY)
            activity.logger.info(
                "snapshot %s %s",
                spec.checkpoint_id,
                result.summary,
                extra={"run_id": spec.run_id, "checkpoint_id": spec.checkpoint_id},
            )
            return result

        @activity.defn(name=NEXT_SEQ_ACTIVITY)
        async def next_snapshot_seq(run_id: str) -> int:
            return await _heartbeating(resolve(run_id).next_seq(), NEXT_SEQ_ACTIVITY)

        @activity.defn(name=RESTORE_CONTROLLER_ACTIVITY)
        async def restore_controller(request: RestoreRequest) -> RestorePlan:
            controller = resolve(request.run_id)
            return await _heartbeating(controller.restore(request), RESTORE_CONTROLLER_ACTIVITY)

        phases = [self._phase_activity(phase) for phase in PHASES]
        return [*phases, abort_snapshot, next_snapshot_seq, restore_controller]
