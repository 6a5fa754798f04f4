"""RolloutSnapshot: one snapshot, the ten phases of docs/design.md section 5 in order.

Every phase is an activity named after it and keyed by ``(checkpoint_id, phase)`` on the
controller side, so a retried or re-run activity has its effect once. ``open`` and ``publish``
(disk work, outside the park window) are regular activities: `temporal workflow describe` shows
them as the pending activity. The phases inside the park window (``close_admission`` to
``resume``) run as *local activities*, in the worker that runs this workflow: no task-queue
round trip each (a window of eight phases paid eight), each still one marker in the history
(``rollsafe.temporal.history``), the phase in the
``RollsafePhase`` search attribute and the workflow's current details. Those are committed when
the workflow task completes, so a phase stuck in the window shows in `describe` once the SDK
heartbeats the workflow task (at 80 % of ``PhaseOptions.task_timeout_s``), and a worker that
dies inside the window hands the snapshot to another one once that timeout passes; the phases
it had done are run again there and answered from the controller's stored results.

``resume`` runs on every exit path: success, failure, abort and cancellation. From ``capture``
on, an abort answers "too late". Each snapshot ends with one line on ``workflow.logger`` (not
while a history replays): published as which snapshot, skipped and why, or failed with the
error's type. An abort (a signal or an update) reaches a snapshot inside the park window at its
next workflow task: when the running phase ends, or at the SDK's heartbeat of the task.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

with workflow.unsafe.imports_passed_through():
    from rollsafe.core.phases import (
        ABANDONING_ERRORS,
        PARK_WINDOW,
        PARTICIPANT_PHASES,
        PHASES,
        SKIPPING_ERRORS,
        Phase,
        PhaseRequest,
        PhaseResult,
        abortable,
    )
    from rollsafe.temporal.failures import root_application_error
    from rollsafe.temporal.search_attributes import KIND, PHASE, RUN_ID
    from rollsafe.workflows.models import (
        PhaseOptions,
        SnapshotInput,
        SnapshotOutcome,
        SnapshotStatus,
    )

ABORT_ACTIVITY = "abort_snapshot"
T = TypeVar("T")
# How a phase's failure reaches the workflow: an ActivityError around the activity's error, or,
# from a local activity, at times the error itself (seen for one whose retries ran out).
PHASE_FAILED = (ActivityError, ApplicationError)
TRAINER_STATE_CHANGED = "trainer_state_changed"
# The patch under which the park window's phases run as local activities (histories recorded
# before it replay them as regular activities: tests/histories/README.md).
LOCAL_PARK_WINDOW = "park-window-local-activities"
# The patch under which a step committed before capture no longer skips a rollout snapshot
# (periodic or on request): its capture, under the controller's barrier, records the state as
# it is then, step included, so what it publishes is consistent whatever committed before. A
# skip there made a snapshot's fate a race between open-to-capture and a training step, which
# a loaded machine lost every time (issue 35: no snapshot at all with 1.5 s steps). An
# anchored (trainer) snapshot still aborts: its capture refuses any weight version but its
# anchor's (AnchorPassed), so going on would only hold the park window for nothing.
OUTLIVES_STEPS = "rollout-snapshot-outlives-steps"
# The loop runs these eight; resume follows in _compensate (on every path out, failures
# included), then publish.
_BEFORE_RESUME = PHASES[: PHASES.index(Phase.RESUME)]


def failure_type(error: BaseException | None) -> tuple[str, bool]:
    """The ApplicationError type at the root of an activity or child failure, and whether it
    may go away on a later try (``non_retryable`` marks invariant errors)."""
    root = root_application_error(error)
    if root is None:
        return "Unknown", True
    return root.type or "ApplicationError", not root.non_retryable


def _cancellation(error: ActivityError | ApplicationError | CancelledError) -> bool:
    """Whether a phase ended because it was cancelled (an abort, or the workflow's cancel)."""
    return isinstance(error, CancelledError) or isinstance(error.cause, CancelledError)


def log_outcome(run_id: str, outcome: SnapshotOutcome) -> SnapshotOutcome:
    """The snapshot's one line: INFO published or skipped, WARNING failed."""
    fields = {
        "run_id": run_id,
        "checkpoint_id": outcome.checkpoint_id,
        "seq": outcome.seq,
        "status": outcome.status,
    }
    if outcome.status == "published":
        name = outcome.published.name if outcome.published is not None else "?"
        workflow.logger.info(
            "snapshot %s published as %s", outcome.checkpoint_id, name, extra=fields
        )
    elif outcome.status == "skipped":
        workflow.logger.info(
            "snapshot %s skipped: %s",
            outcome.checkpoint_id,
            outcome.reason,
            extra={**fields, "reason": outcome.reason},
        )
    else:
        workflow.logger.warning(
            "snapshot %s failed (%s): %s: %s",
            outcome.checkpoint_id,
            "transient" if outcome.transient else "not transient",
            outcome.error_type,
            outcome.reason,
            extra={
                **fields,
                "reason": outcome.reason,
                "error_type": outcome.error_type,
                "transient": outcome.transient,
            },
        )
    return outcome


def _retry(options: PhaseOptions) -> RetryPolicy:
    return RetryPolicy(
        initial_interval=timedelta(seconds=options.retry_initial_s),
        maximum_interval=timedelta(seconds=options.retry_maximum_s),
        maximum_attempts=options.retry_attempts,
        # Not compared on replay (tests/histories/README.md): no patch needed.
        non_retryable_error_types=sorted(ABANDONING_ERRORS),
    )


def start_local_activity(
    name: str, arg: object, result_type: type[T], options: PhaseOptions
) -> workflow.ActivityHandle[T]:
    """A short bookkeeping step run in the worker that runs the workflow: no round trip."""
    handle: workflow.ActivityHandle[T] = workflow.start_local_activity(
        name,
        arg,
        result_type=result_type,
        activity_id=name,
        start_to_close_timeout=timedelta(seconds=options.start_to_close_s),
        retry_policy=_retry(options),
    )
    return handle


def start_activity(
    name: str, arg: object, result_type: type[T], options: PhaseOptions
) -> workflow.ActivityHandle[T]:
    """Start a rollsafe activity by name (workflow code never imports activity modules)
    with the phase timeouts and retry policy; the activity id is its name."""
    handle: workflow.ActivityHandle[T] = workflow.start_activity(
        name,
        arg,
        result_type=result_type,
        activity_id=name,
        start_to_close_timeout=timedelta(seconds=options.start_to_close_s),
        heartbeat_timeout=timedelta(seconds=options.heartbeat_timeout_s),
        retry_policy=_retry(options),
    )
    return handle


@workflow.defn(name="RolloutSnapshot")
class RolloutSnapshot:
    @workflow.init
    def __init__(self, request: SnapshotInput) -> None:
        # The input here too: a signal can arrive before run starts, and its handler needs
        # the snapshot's kind.
        self._kind = request.spec.kind
        self._steps_committed: list[int] = []  # before capture, in a rollout snapshot
        self._phase: Phase | None = None
        self._phase_started_at: float | None = None
        self._abort_reason: str | None = None
        self._results: list[PhaseResult] = []
        self._checkpoint_id = ""
        self._local_park = False  # the park window's phases as local activities

    @workflow.run
    async def run(self, request: SnapshotInput) -> SnapshotOutcome:
        spec = request.spec
        self._checkpoint_id = spec.checkpoint_id
        self._local_park = workflow.patched(LOCAL_PARK_WINDOW)
        workflow.upsert_search_attributes(
            [RUN_ID.value_set(spec.run_id), KIND.value_set(spec.kind)]
        )
        outcome: SnapshotOutcome | None = None
        try:
            for phase in _BEFORE_RESUME:
                if self._abort_reason is not None:  # only ever set while abortable
                    outcome = self._outcome(request, "skipped", self._abort_reason)
                    break
                await self._run_phase(request, phase)
        except PHASE_FAILED as exc:
            error_type, transient = failure_type(exc)
            reason = str(exc.cause or exc)
            if error_type in SKIPPING_ERRORS:
                outcome = self._outcome(request, "skipped", reason)
            else:
                outcome = self._outcome(request, "failed", reason, error_type)
                outcome = outcome.model_copy(update={"transient": transient})
        except (asyncio.CancelledError, CancelledError):
            workflow.logger.info("snapshot %s cancelled: resuming", spec.checkpoint_id)
            await self._compensate(request, discard=True)
            raise
        if outcome is not None:
            await self._compensate(request, discard=True)
            return log_outcome(spec.run_id, outcome)
        # The park window ends as soon as the state is captured: resume before publish.
        await self._compensate(request, discard=False)
        try:
            published = await self._run_phase(request, Phase.PUBLISH)
        except PHASE_FAILED as exc:
            error_type, transient = failure_type(exc)
            failed = self._outcome(request, "failed", str(exc.cause or exc), error_type)
            return log_outcome(spec.run_id, failed.model_copy(update={"transient": transient}))
        done = self._outcome(request, "published")
        return log_outcome(spec.run_id, done.model_copy(update={"published": published.published}))

    async def _run_phase(self, request: SnapshotInput, phase: Phase) -> PhaseResult:
        self._phase, self._phase_started_at = phase, workflow.time()
        workflow.upsert_search_attributes([PHASE.value_set(phase.value)])
        workflow.set_current_details(f"snapshot {self._checkpoint_id}: phase **{phase.value}**")
        phase_request = PhaseRequest(
            spec=request.spec, phase=phase, admission_lease_s=request.options.admission_lease_s
        )
        if self._local(request, phase):
            handle = start_local_activity(phase.value, phase_request, PhaseResult, request.options)
        else:
            handle = start_activity(phase.value, phase_request, PhaseResult, request.options)
        if abortable(phase):
            await workflow.wait_condition(lambda: handle.done() or self._abort_reason is not None)
            if not handle.done():
                handle.cancel()  # the activity learns of it at its next heartbeat
        try:
            result = await handle
        except (*PHASE_FAILED, CancelledError) as exc:
            if not _cancellation(exc):
                raise
            if self._abort_reason is None:  # a local activity cancelled with the workflow
                raise asyncio.CancelledError from exc
            return PhaseResult(phase=phase, checkpoint_id=self._checkpoint_id, summary="aborted")
        self._results.append(result)
        return result

    def _local(self, request: SnapshotInput, phase: Phase) -> bool:
        """Whether ``phase`` runs as a local activity (see the module docstring)."""
        if self._local_park and request.options.local_park_window and phase in PARK_WINDOW:
            return True
        return phase in PARTICIPANT_PHASES and not request.participants

    async def _compensate(self, request: SnapshotInput, discard: bool) -> None:
        """Reopen admission and resume environments; on a snapshot that will not publish,
        also throw its draft away. Retried until done: a lost resume is covered by the
        environments' lease, but admission must not stay closed."""
        options = request.options.model_copy(update={"retry_attempts": 1_000_000})
        self._phase, self._phase_started_at = Phase.RESUME, workflow.time()
        workflow.upsert_search_attributes([PHASE.value_set(Phase.RESUME.value)])
        start = start_local_activity if self._local(request, Phase.RESUME) else start_activity
        result = await start(
            Phase.RESUME.value,
            PhaseRequest(spec=request.spec, phase=Phase.RESUME),
            PhaseResult,
            options,
        )
        self._results.append(result)
        if discard:
            await start_activity(ABORT_ACTIVITY, request.spec, PhaseResult, options)

    def _outcome(
        self, request: SnapshotInput, status: str, reason: str = "", error_type: str = ""
    ) -> SnapshotOutcome:
        return SnapshotOutcome(
            checkpoint_id=self._checkpoint_id,
            seq=request.spec.seq,
            status=status,
            reason=reason,
            error_type=error_type,
            phases=list(self._results),
        )

    @workflow.update
    async def abort(self, reason: str) -> str:
        self._abort_reason = reason
        return f"abort accepted in phase {self._phase.value if self._phase else 'none'}"

    @abort.validator
    def _abort_allowed(self, reason: str) -> None:
        if not abortable(self._phase):
            assert self._phase is not None
            raise ApplicationError(
                f"too late: snapshot {self._checkpoint_id} is in phase {self._phase.value}",
                type="TooLate",
            )

    @workflow.signal(name=TRAINER_STATE_CHANGED)
    def trainer_state_changed(self, step: int) -> None:
        """A train step committed before capture: a rollout snapshot notes it and goes on (its
        capture includes the step), an anchored one aborts (``OUTLIVES_STEPS``)."""
        if not abortable(self._phase):
            return
        if self._kind == "rollout" and workflow.patched(OUTLIVES_STEPS):
            self._steps_committed.append(step)
            return
        self._abort_reason = f"trainer_state_changed: step {step} committed"

    @workflow.query
    def status(self) -> SnapshotStatus:
        return SnapshotStatus(
            checkpoint_id=self._checkpoint_id,
            phase=self._phase,
            phase_started_at=self._phase_started_at,
            abort_reason=self._abort_reason,
            completed=[r.phase for r in self._results],
            steps_committed=list(self._steps_committed),
        )
