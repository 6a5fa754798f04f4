"""The trainer SDK: how a training loop tells its run's checkpoint workflows what happened.

::

    ckpt = await Checkpointer("run-7", interval_s=600).start()
    for step in ...:
        ...  # optimizer step committed
        await ckpt.train_step_committed(step)
    outcome = await ckpt.snapshot_now(timeout=120)

Every call first asks the Temporal server about the run's supervisor (``rollsafe/{run_id}``):
once it has failed, every call raises :class:`SnapshotsFailed` naming why, so a trainer
learns that its run is no longer being checkpointed at its next step, not from a log line.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Self, TypeVar

from temporalio.client import (
    Client,
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from rollsafe.errors import CheckpointTimeout, InvariantError, TemporalUnavailable, TransientError
from rollsafe.ids import validate_run_id
from rollsafe.phases import RestorePlan, RestoreRequest
from rollsafe.temporal.connect import ConnectionSettings, connect
from rollsafe.temporal.failures import describe_failure
from workflows.models import (
    PhaseOptions,
    SnapshotOutcome,
    SupervisorConfig,
    SupervisorInput,
    SupervisorStatus,
)
from workflows.restore import RestoreRun, restore_workflow_id
from workflows.snapshot import RolloutSnapshot
from workflows.supervisor import SnapshotSupervisor, supervisor_id, task_queue_for

# Queries and updates need a live worker: say so, rather than hang, when none serves the run.
WORKER_TIMEOUT_S = 5.0
_ACCEPTED = "abort accepted in phase "  # RolloutSnapshot.abort's answer, then the phase
_TOO_LATE = "TooLate"  # RolloutSnapshot.abort's validator refusal

T = TypeVar("T")
SupervisorHandle = WorkflowHandle[SnapshotSupervisor, None]


async def _within(seconds: float | None, call: Awaitable[T]) -> T:
    """``call``, or TimeoutError after ``seconds``. The SDK turns the deadline's cancellation
    of an update into its own error: ask the deadline whether it fired instead."""
    try:
        async with asyncio.timeout(seconds) as deadline:
            return await call
    except WorkflowUpdateRPCTimeoutOrCancelledError:
        if deadline.expired():
            raise TimeoutError from None
        raise


class SnapshotsFailed(InvariantError):
    """The run's supervisor failed: no more snapshots are taken until a trainer starts a new
    one (``Checkpointer.start``). ``failure_type`` is the supervisor's error type, e.g.
    ``TooManyConsecutiveSnapshotFailures`` or the invariant error that failed a snapshot."""

    def __init__(self, run_id: str, failure_type: str, message: str) -> None:
        self.run_id = run_id
        self.failure_type = failure_type
        super().__init__(f"checkpointing of run {run_id!r} failed: {failure_type}: {message}")


class RestoreFailed(InvariantError):
    """The run could not be restored (no snapshot verifies, topology differs, ...)."""


class SupervisorNotRunning(InvariantError):
    """The run has no running supervisor: never started, stopped or terminated."""


class NoWorker(TransientError):
    """No checkpoint worker answered a query: none serves the run's task queue right now."""


class Checkpointer:
    """One run's checkpointing, seen from the trainer. ``client`` (tests, or a caller that
    already has one) must use the pydantic data converter, as
    :func:`rollsafe.temporal.connect.connect` does; otherwise ``settings`` are used to connect.

    ``interval_s``, ``max_consecutive_failures`` and ``options`` configure the supervisor when
    :meth:`start` creates it; a trainer attaching to a running one gets that one's settings.
    """

    worker_timeout_s = WORKER_TIMEOUT_S  # how long a call waits for a worker to answer

    def __init__(
        self,
        run_id: str,
        *,
        settings: ConnectionSettings | None = None,
        task_queue: str | None = None,
        interval_s: float | None = None,
        max_consecutive_failures: int = 3,
        options: PhaseOptions | None = None,
        participants: bool = True,
        client: Client | None = None,
    ) -> None:
        self.run_id = validate_run_id(run_id)
        self.task_queue = task_queue or task_queue_for(run_id)
        self.config = SupervisorConfig(
            run_id=run_id,
            interval_s=interval_s,
            max_consecutive_failures=max_consecutive_failures,
            # False: the run has no environments or engines (see SnapshotInput.participants)
            participants=participants,
            options=options or PhaseOptions(),
        )
        # Trainer checkpoint paths by step: the supervisor's signal carries only the step.
        self.saved_checkpoints: dict[int, str] = {}
        self._settings = settings
        self._client = client

    @property
    def workflow_id(self) -> str:
        return supervisor_id(self.run_id)

    async def start(self) -> Self:
        """Connect (unless a client was given) and start the run's supervisor, or attach to
        the one already running: a restarted trainer continues the same run's checkpointing.
        After a failed or stopped supervisor this starts a fresh one."""
        if self._client is None:
            self._client = await connect(self._settings)
        await self._client.start_workflow(
            SnapshotSupervisor.run,
            SupervisorInput(config=self.config),
            id=self.workflow_id,
            task_queue=self.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
        return self

    async def train_step_committed(self, step: int) -> str:
        """Tell the run a train step committed; a snapshot that has not captured yet is now
        stale and aborts. Returns what happened to the running snapshot, one line:
        ``aborted snapshot <seq> in phase <p>``, ``too late: ...`` (it captured already and
        will publish) or ``no snapshot running``."""
        async with self._supervisor() as (handle, description):
            answer = "no snapshot running"
            # The running snapshot from the server's record of pending children, not the
            # status query: a query needs a worker, and a trainer step must not wait for one.
            for child in description.raw_description.pending_children:
                if child.workflow_type_name == RolloutSnapshot.__name__:
                    answer = await self._abort(child.workflow_id, step)
            # After the abort, so its answer is the child's own: the supervisor signals the
            # child too, and a child aborted that way first would answer "too late" (resume).
            await handle.signal(SnapshotSupervisor.train_step_committed, step)
            return answer

    async def _abort(self, workflow_id: str, step: int) -> str:
        assert self._client is not None
        seq = workflow_id.rpartition("/")[2]
        child = self._client.get_workflow_handle_for(RolloutSnapshot.run, workflow_id)
        try:
            answer = await _within(
                self.worker_timeout_s,
                child.execute_update(
                    RolloutSnapshot.abort, f"trainer_state_changed: step {step} committed"
                ),
            )
        except TimeoutError:
            return (
                f"abort of snapshot {seq} unconfirmed: no worker answered within "
                f"{self.worker_timeout_s:g} s (the supervisor aborts it when one does)"
            )
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.type == _TOO_LATE:
                return "too late: " + cause.message.removeprefix("too late: ")
            return f"no snapshot running (snapshot {seq}: {cause})"
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            return f"no snapshot running (snapshot {seq} is not running now)"
        return f"aborted snapshot {seq} in phase {answer.removeprefix(_ACCEPTED)}"

    async def trainer_checkpoint_saved(self, step: int, path: str) -> None:
        """Ask for a trainer snapshot anchored at ``step``. ``path`` (the trainer checkpoint)
        is kept in :attr:`saved_checkpoints` on this side only: the supervisor's signal carries
        the step alone, so the operator view does not show it yet."""
        async with self._supervisor() as (handle, _):
            await handle.signal(SnapshotSupervisor.trainer_checkpoint_saved, step)
            self.saved_checkpoints[step] = path

    async def snapshot_now(self, timeout: float | None = None) -> SnapshotOutcome:
        """Take a rollout snapshot now (after any queued ones) and return its outcome. After
        ``timeout`` seconds raises :class:`CheckpointTimeout`; a request that reached the
        supervisor is not withdrawn: that snapshot still runs, and its outcome later shows in
        ``status().state.last_outcome``."""
        async with self._supervisor() as (handle, _):
            try:
                return await _within(
                    timeout, handle.execute_update(SnapshotSupervisor.snapshot_now)
                )
            except TimeoutError:
                raise CheckpointTimeout(
                    f"run {self.run_id!r}: snapshot_now did not finish within {timeout:g} s"
                ) from None

    async def status(self) -> SupervisorStatus:
        """The supervisor's counts, last outcome and running snapshot. Raises
        :class:`NoWorker` when no checkpoint worker answers (queries run on a worker)."""
        async with self._supervisor() as (handle, _):
            try:
                return await handle.query(
                    SnapshotSupervisor.status, rpc_timeout=timedelta(seconds=self.worker_timeout_s)
                )
            except RPCError as exc:
                # The server holds a query until a worker takes it: a timeout means none did.
                if exc.status not in (RPCStatusCode.CANCELLED, RPCStatusCode.DEADLINE_EXCEEDED):
                    raise
                await self._running(handle)  # closed meanwhile: say so instead
                raise NoWorker(
                    f"run {self.run_id!r}: no checkpoint worker answered within "
                    f"{self.worker_timeout_s:g} s; is one serving task queue {self.task_queue!r}?"
                ) from None

    async def stop(self) -> None:
        """End the run's periodic snapshots (the supervisor finishes its current one first)."""
        async with self._supervisor() as (handle, _):
            await handle.signal(SnapshotSupervisor.stop)

    async def restore(
        self, restore_id: str, weight_versions: Sequence[int] | None = None
    ) -> RestorePlan:
        """Restore the run's controller from its newest snapshot that verifies, through the
        RestoreRun workflow (DESIGN.md section 6). Idempotent per ``restore_id``: a retried
        restore returns the first plan. Needs no supervisor: a trainer restores before
        :meth:`start`. ``weight_versions``: those the trainer holds checkpoints of; only a
        snapshot taken at one of them is restored (None: any). A snapshot that cannot be
        restored raises :class:`RestoreFailed` naming the error; the run refuses to start
        rather than start from nothing."""
        if self._client is None:
            self._client = await connect(self._settings)
        anchors = tuple(weight_versions) if weight_versions is not None else None
        request = RestoreRequest(run_id=self.run_id, restore_id=restore_id, weight_versions=anchors)
        try:
            return await self._client.execute_workflow(
                RestoreRun.run,
                request,
                id=restore_workflow_id(self.run_id, restore_id),
                task_queue=self.task_queue,
            )
        except WorkflowFailureError as exc:
            error_type, message = describe_failure(exc)
            raise RestoreFailed(
                f"restore of run {self.run_id!r} failed: {error_type}: {message}"
            ) from exc

    @asynccontextmanager
    async def _supervisor(
        self,
    ) -> AsyncIterator[tuple[SupervisorHandle, WorkflowExecutionDescription]]:
        """The running supervisor's handle and description. A failed or closed supervisor
        raises its own error, also when it closes during the call, never a bare RPC error."""
        if self._client is None:
            raise SupervisorNotRunning(f"run {self.run_id!r}: call Checkpointer.start() first")
        handle = self._client.get_workflow_handle_for(SnapshotSupervisor.run, self.workflow_id)
        description = await self._running(handle)
        try:
            yield handle, description
        except (RPCError, WorkflowQueryFailedError, WorkflowUpdateFailedError):
            await self._running(handle)  # raises the supervisor's own error if it closed
            raise

    async def _running(self, handle: SupervisorHandle) -> WorkflowExecutionDescription:
        try:
            description = await handle.describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise TemporalUnavailable(
                    f"run {self.run_id!r}: describing {self.workflow_id} failed: "
                    f"{exc.status.name} {exc.message}"
                ) from exc
            raise SupervisorNotRunning(
                f"run {self.run_id!r} has no checkpoint supervisor ({self.workflow_id}); "
                "call Checkpointer.start() first"
            ) from None
        if description.status == WorkflowExecutionStatus.RUNNING:
            return description
        if description.status == WorkflowExecutionStatus.FAILED:
            raise await self._failure(description.run_id)
        state = description.status.name if description.status else "UNKNOWN"
        raise SupervisorNotRunning(
            f"checkpoint supervisor of run {self.run_id!r} is {state}; call "
            "Checkpointer.start() to start a new one"
        )

    async def _failure(self, run_id: str) -> SnapshotsFailed:
        # describe() has no failure details; the failed run's result has the typed error
        # (that run exactly: a trainer may have started a new supervisor meanwhile).
        assert self._client is not None
        try:
            await self._client.get_workflow_handle(self.workflow_id, run_id=run_id).result()
        except WorkflowFailureError as exc:
            return SnapshotsFailed(self.run_id, *describe_failure(exc))
        return SnapshotsFailed(self.run_id, "Unknown", "the supervisor failed")
