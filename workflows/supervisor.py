"""SnapshotSupervisor: one per run (id ``rollsafe/{run_id}``), one snapshot at a time.

Takes periodic snapshots on a timer, anchored snapshots when the trainer saves a checkpoint,
and snapshots on demand (``snapshot_now``). Keeps the run's anchors (weight versions the
trainer holds checkpoints of, from ``trainer_checkpoint_saved`` / ``_removed`` / ``_held``)
and hands them to every snapshot, whose retention keeps the newest snapshot at each.
Transient failures are counted across snapshots; after ``max_consecutive_failures`` in a row,
or at once on an invariant failure, the supervisor fails with a typed error the trainer's
next SDK call sees. Continues as new before its history grows large.

Each snapshot's outcome is logged by its own workflow; the supervisor adds its tally on
``workflow.logger`` (not while a history replays): DEBUG after a published or skipped
snapshot, WARNING after a failure (how many in a row, of how many allowed), ERROR when it gives
up.
"""

from __future__ import annotations

from collections import deque
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from rollsafe.core.ids import snapshot_workflow_id
    from rollsafe.core.phases import SnapshotSpec
    from rollsafe.temporal.search_attributes import KIND, RUN_ID
    from rollsafe.workflows.models import (
        SnapshotInput,
        SnapshotOutcome,
        SupervisorConfig,
        SupervisorInput,
        SupervisorStatus,
        unpublished_warning,
    )
    from rollsafe.workflows.snapshot import (
        TRAINER_STATE_CHANGED,
        RolloutSnapshot,
        failure_type,
        start_activity,
    )

NEXT_SEQ_ACTIVITY = "next_snapshot_seq"
TOO_MANY_FAILURES = "TooManyConsecutiveSnapshotFailures"
# A gauge on the SDK's metric meter (exported with the worker's Temporal metrics; never
# emitted while a history replays).
UNPUBLISHED_GAUGE = "rollsafe_snapshots_unpublished_in_a_row"


@workflow.defn(name="SnapshotSupervisor")
class SnapshotSupervisor:
    # @workflow.init: the state exists before any handler runs. A signal or update that
    # arrives with the workflow's first task is handled before run() starts; a state set up
    # in run() would then overwrite what it did (an anchor it added was lost that way).
    @workflow.init
    def __init__(self, request: SupervisorInput) -> None:
        self._config: SupervisorConfig | None = request.config
        self._state = request.state.model_copy(deep=True)
        self._requests: deque[tuple[int, str, int | None]] = deque()  # (ticket, kind, anchor)
        self._tickets = 0
        self._outcomes: dict[int, SnapshotOutcome] = {}  # of the tickets an update waits on
        self._awaited: set[int] = set()
        self._running: int | None = None
        self._stop = False
        self._taken = 0  # snapshots taken by this run of the workflow (not carried over)

    @workflow.run
    async def run(self, request: SupervisorInput) -> None:
        config = request.config
        for step in self._state.pending_anchors:
            self._enqueue("trainer", step)
        workflow.upsert_search_attributes(
            [RUN_ID.value_set(config.run_id), KIND.value_set("supervisor")]
        )
        if self._state.next_seq is None:
            self._state.next_seq = await start_activity(
                NEXT_SEQ_ACTIVITY, config.run_id, int, config.options
            )
        while not self._stop:
            timeout = timedelta(seconds=config.interval_s) if config.interval_s else None
            try:
                await workflow.wait_condition(
                    lambda: bool(self._requests) or self._stop, timeout=timeout
                )
            except TimeoutError:
                self._enqueue("rollout", None)  # the periodic snapshot
            if self._requests:
                await self._take(*self._requests.popleft())
            if self._requests or not (
                workflow.info().is_continue_as_new_suggested()
                or self._taken >= config.snapshots_per_run
            ):
                continue
            # Continue as new only with nothing queued: a queued request may have an update
            # waiting on it, and waiting for that handler would never end.
            await workflow.wait_condition(
                lambda: workflow.all_handlers_finished() or bool(self._requests)
            )
            if not self._requests:
                workflow.continue_as_new(SupervisorInput(config=config, state=self._state))

    def _enqueue(self, kind: str, anchor: int | None) -> int:
        self._tickets += 1
        self._requests.append((self._tickets, kind, anchor))
        return self._tickets

    async def _take(self, ticket: int, kind: str, anchor: int | None) -> None:
        config, state = self._config, self._state
        assert config is not None and state.next_seq is not None
        seq = state.next_seq
        state.next_seq += 1
        self._taken += 1
        spec = SnapshotSpec(
            run_id=config.run_id,
            seq=seq,
            kind=kind,
            anchor_step=anchor,
            anchors=tuple(state.anchors),
        )
        self._running = seq
        try:
            outcome = await workflow.execute_child_workflow(
                RolloutSnapshot.run,
                SnapshotInput(spec=spec, options=config.options, participants=config.participants),
                id=snapshot_workflow_id(config.run_id, seq),
                task_timeout=timedelta(seconds=config.options.task_timeout_s),
            )
        except ChildWorkflowError as exc:
            error_type, transient = failure_type(exc)
            outcome = SnapshotOutcome(
                checkpoint_id=spec.checkpoint_id,
                seq=seq,
                status="failed",
                reason=str(exc.cause or exc),
                error_type=error_type,
                transient=transient,
            )
        finally:
            self._running = None
        if ticket in self._awaited:
            self._outcomes[ticket] = outcome
        self._record(outcome)

    def _record(self, outcome: SnapshotOutcome) -> None:
        config, state = self._config, self._state
        assert config is not None
        state.last_outcome = outcome
        fields = {"run_id": config.run_id, "checkpoint_id": outcome.checkpoint_id}
        self._count_unpublished(outcome)
        if outcome.status != "failed":
            state.consecutive_failures = 0
            if outcome.status == "published":
                state.published += 1
            else:
                state.skipped += 1
            workflow.logger.debug(
                "run %s: snapshot %s %s (published %d, skipped %d, failed %d)",
                config.run_id,
                outcome.checkpoint_id,
                outcome.status,
                state.published,
                state.skipped,
                state.failed,
                extra=fields,
            )
            return
        state.failed += 1
        if not outcome.transient:
            workflow.logger.error(
                "run %s: snapshot %s failed with an invariant error (%s): the supervisor stops",
                config.run_id,
                outcome.checkpoint_id,
                outcome.error_type,
                extra={**fields, "error_type": outcome.error_type},
            )
            raise ApplicationError(
                f"snapshot {outcome.checkpoint_id} failed: {outcome.error_type}: {outcome.reason}",
                type=outcome.error_type,
                non_retryable=True,
            )
        state.consecutive_failures += 1
        self._log_failures_in_a_row(outcome, config.max_consecutive_failures)
        if state.consecutive_failures >= config.max_consecutive_failures:
            raise ApplicationError(
                f"{state.consecutive_failures} snapshots in a row failed; last: "
                f"{outcome.error_type}: {outcome.reason}",
                type=TOO_MANY_FAILURES,
                non_retryable=True,
            )

    def _count_unpublished(self, outcome: SnapshotOutcome) -> None:
        """Skipped or failed snapshots in a row: a WARNING each from ``warn_unpublished_after``
        on, and the gauge ``rollsafe_snapshots_unpublished_in_a_row`` (the SDK's metrics)."""
        config, state = self._config, self._state
        assert config is not None
        if outcome.status == "published":
            state.unpublished_in_a_row = 0
        else:
            state.unpublished_in_a_row += 1
        gauge = workflow.metric_meter().create_gauge(
            UNPUBLISHED_GAUGE, "snapshots in a row that ended skipped or failed"
        )
        gauge.set(state.unpublished_in_a_row, {"run_id": config.run_id})
        warning = unpublished_warning(state, config.warn_unpublished_after)
        if warning is not None:
            workflow.logger.warning(
                "run %s: %s",
                config.run_id,
                warning,
                extra={
                    "run_id": config.run_id,
                    "checkpoint_id": outcome.checkpoint_id,
                    "unpublished_in_a_row": state.unpublished_in_a_row,
                },
            )

    def _log_failures_in_a_row(self, outcome: SnapshotOutcome, allowed: int) -> None:
        assert self._config is not None
        in_a_row = self._state.consecutive_failures
        gives_up = in_a_row >= allowed
        log = workflow.logger.error if gives_up else workflow.logger.warning
        log(
            "run %s: snapshot %s failed (%s), %d in a row of %d allowed%s",
            self._config.run_id,
            outcome.checkpoint_id,
            outcome.error_type,
            in_a_row,
            allowed,
            ": the supervisor stops" if gives_up else "",
            extra={
                "run_id": self._config.run_id,
                "checkpoint_id": outcome.checkpoint_id,
                "error_type": outcome.error_type,
                "consecutive_failures": in_a_row,
            },
        )

    @workflow.signal
    def trainer_checkpoint_saved(self, step: int) -> None:
        """A trainer checkpoint of weight version ``step``: an anchored snapshot, and an
        anchor retention keeps a snapshot for until the checkpoint is removed."""
        self._anchor(step)

    @workflow.update
    async def trainer_checkpoint_snapshot(self, step: int) -> SnapshotOutcome:
        """:meth:`trainer_checkpoint_saved`, answered with its anchored snapshot's outcome."""
        return await self._outcome_of(self._anchor(step))

    def _anchor(self, step: int) -> int:
        self._state.anchors = sorted({*self._state.anchors, step})
        return self._enqueue("trainer", step)

    async def _outcome_of(self, ticket: int) -> SnapshotOutcome:
        self._awaited.add(ticket)
        await workflow.wait_condition(lambda: ticket in self._outcomes)
        self._awaited.discard(ticket)
        return self._outcomes.pop(ticket)

    @workflow.signal
    def trainer_checkpoint_removed(self, step: int) -> None:
        """The trainer deleted its checkpoint of weight version ``step``: no longer an anchor."""
        self._state.anchors = [held for held in self._state.anchors if held != step]

    @workflow.signal
    def trainer_checkpoints_held(self, steps: list[int]) -> None:
        """Every anchor the trainer holds (a restarted trainer says so): replaces the set."""
        self._state.anchors = sorted(set(steps))

    @workflow.signal
    async def train_step_committed(self, step: int) -> None:
        """A committed step, passed on to the running snapshot: an anchored one still before
        capture aborts (outcome skipped: trainer_state_changed); a rollout one notes it."""
        self._state.last_committed_step = step
        if self._running is not None and self._config is not None:
            child = workflow.get_external_workflow_handle(
                snapshot_workflow_id(self._config.run_id, self._running)
            )
            try:
                await child.signal(TRAINER_STATE_CHANGED, step)
            except ApplicationError as exc:
                # The snapshot ended meanwhile: nothing left to abort. An error escaping a
                # signal handler would fail the whole supervisor.
                if exc.type != "ExternalWorkflowExecutionNotFound":
                    raise

    @workflow.update
    async def snapshot_now(self) -> SnapshotOutcome:
        return await self._outcome_of(self._enqueue("rollout", None))

    @workflow.signal
    def stop(self) -> None:
        self._stop = True

    @workflow.query
    def status(self) -> SupervisorStatus:
        assert self._config is not None
        running = self._running
        return SupervisorStatus(
            run_id=self._config.run_id,
            state=self._state,
            running_seq=running,
            running_workflow_id=snapshot_workflow_id(self._config.run_id, running)
            if running
            else None,
            queued_requests=len(self._requests),
            warning=unpublished_warning(self._state, self._config.warn_unpublished_after),
        )
