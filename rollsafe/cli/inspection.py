"""``rollsafe inspect RUN``: one human view of a run's checkpointing, built from what the
Temporal server knows (describe and search attributes), so it works with no worker alive;
the supervisor's own status query is added when a worker answers."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel, ConfigDict
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.workflow.v1 import PendingActivityInfo
from temporalio.api.workflowservice.v1 import DescribeWorkflowExecutionResponse
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowQueryFailedError,
)
from temporalio.service import RPCError, RPCStatusCode

from rollsafe.core.ids import supervisor_id, task_queue_for
from rollsafe.core.phases import PARK_WINDOW, PHASES, Phase
from rollsafe.errors import RunNotFound
from rollsafe.temporal.failures import describe_failure
from rollsafe.temporal.history import CompletedActivity, completed_activities, task_progress
from rollsafe.temporal.pollers import WorkerPresence, worker_presence
from rollsafe.temporal.search_attributes import KIND, PHASE, RUN_ID
from rollsafe.workflows.models import SupervisorStatus
from rollsafe.workflows.supervisor import SnapshotSupervisor

QUERY_TIMEOUT_S = 2.0
REPORTED_PROBLEMS = "TemporalReportedProblems"
_LOCAL_PHASES = frozenset(phase.value for phase in PARK_WINDOW)
_STATE_PREFIX = "PENDING_ACTIVITY_STATE_"


class PendingPhase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    activity: str
    attempt: int
    state: str
    last_failure: str | None
    last_heartbeat_age_s: float | None


class SnapshotView(BaseModel):
    model_config = ConfigDict(extra="forbid")

    workflow_id: str
    kind: str | None
    # The RollsafePhase search attribute, or what the history says when that is behind (a
    # worker that dies inside the park window never records the window's upserts).
    phase: str | None
    running_for_s: float
    pending: list[PendingPhase]
    worker: str | None = None  # who holds it: the pending activity's, or the workflow task's
    # Admission closed (the park window entered) at this time (unix seconds), not reopened.
    parked_since: float | None = None
    task_attempts: int = 0  # of its pending workflow task: above 1, tasks failed or timed out
    task_trouble: str | None = None  # the newest failed or timed-out workflow task, and why
    reported_problems: list[str] = []  # the server's TemporalReportedProblems


class RunView(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str
    supervisor: str  # the supervisor workflow's status (RUNNING, FAILED, ...) or "absent"
    supervisor_failure: str | None = None
    status: SupervisorStatus | None = None  # None: no worker answered the query
    workers: WorkerPresence | None = None  # who polls the run's task queue
    snapshots: list[SnapshotView] = []


def _age(moment: datetime | None, now: float) -> float | None:
    return None if moment is None else max(0.0, now - moment.timestamp())


async def inspect_run(client: Client, run_id: str, task_queue: str | None = None) -> RunView:
    """The run's view; :class:`RunNotFound` when the server knows nothing of the run."""
    queue = task_queue or task_queue_for(run_id)
    view = RunView(run_id=run_id, supervisor="absent")
    workers = await worker_presence(client, queue)
    view.workers = workers
    handle = client.get_workflow_handle_for(SnapshotSupervisor.run, supervisor_id(run_id))
    supervisor_missing = False
    try:
        description = await handle.describe()
    except RPCError as exc:
        description = None  # no supervisor (snapshots may still be started directly)
        supervisor_missing = exc.status == RPCStatusCode.NOT_FOUND
    if description is not None:
        view.supervisor = description.status.name if description.status else "UNKNOWN"
        if description.status == WorkflowExecutionStatus.FAILED:
            view.supervisor_failure = await _failure_of(client, supervisor_id(run_id))
        if description.status == WorkflowExecutionStatus.RUNNING:
            try:
                view.status = await handle.query(
                    SnapshotSupervisor.status, rpc_timeout=timedelta(seconds=QUERY_TIMEOUT_S)
                )
            except (RPCError, WorkflowQueryFailedError):
                view.status = None  # no live worker answered: server-side state only
    view.snapshots = await _running_snapshots(client, run_id, queue)
    if (
        supervisor_missing
        and not view.snapshots
        and not workers.pollers
        and not await _any_workflow(client, run_id, queue)
    ):
        raise RunNotFound(
            f"no run {run_id!r} in Temporal namespace {client.namespace!r} at "
            f"{client.service_client.config.target_host}: no supervisor workflow "
            f"{supervisor_id(run_id)!r}, no workflow of the run or on task queue {queue!r}, "
            "and no worker has polled that queue (check the run id, and TEMPORAL_NAMESPACE "
            "/ TEMPORAL_ADDRESS)"
        )
    return view


async def _any_workflow(client: Client, run_id: str, queue: str) -> bool:
    """Whether any workflow, open or closed, carries the run's id or ran on its task queue
    (a snapshot started with no worker has no search attributes yet: its queue finds it)."""
    query = f"{RUN_ID.name} = '{run_id}' OR TaskQueue = '{queue}'"
    return (await client.count_workflows(query)).count > 0


async def _running_snapshots(client: Client, run_id: str, queue: str) -> list[SnapshotView]:
    # By task queue too: a snapshot whose first workflow task never completed has no
    # search attributes yet.
    query = (
        f"({RUN_ID.name} = '{run_id}' OR TaskQueue = '{queue}') "
        "AND WorkflowType = 'RolloutSnapshot' AND ExecutionStatus = 'Running'"
    )
    now = time.time()
    views = []
    async for execution in client.list_workflows(query):
        handle = client.get_workflow_handle(execution.id)
        description = await handle.describe()
        attrs = description.typed_search_attributes
        pending = [
            PendingPhase(
                activity=info.activity_type.name,
                attempt=info.attempt,
                state=PendingActivityState.Name(info.state).removeprefix(_STATE_PREFIX),
                last_failure=info.last_failure.message or None,
                last_heartbeat_age_s=_age(
                    info.last_heartbeat_time.ToDatetime(UTC)
                    if info.HasField("last_heartbeat_time")
                    else None,
                    now,
                ),
            )
            for info in description.raw_description.pending_activities
        ]
        events = [event async for event in handle.fetch_history_events()]
        raw = description.raw_description
        view = SnapshotView(
            workflow_id=execution.id,
            kind=attrs.get(KIND),
            phase=attrs.get(PHASE),
            running_for_s=_age(execution.start_time, now) or 0.0,
            pending=pending,
            task_attempts=raw.pending_workflow_task.attempt
            if raw.HasField("pending_workflow_task")
            else 0,
            reported_problems=_reported_problems(raw),
        )
        views.append(_from_history(view, events, raw.pending_activities))
    return views


def _from_history(
    view: SnapshotView, events: list[HistoryEvent], pending: Iterable[PendingActivityInfo]
) -> SnapshotView:
    """The phase, the holding worker, the park and the workflow tasks' trouble, as the
    snapshot's history says them."""
    activities = completed_activities(events)
    done = [activity.name for activity in activities]
    progress = task_progress(events)
    view.phase = phase_from_history(view.phase, done)
    running = [info.last_worker_identity for info in pending if info.last_worker_identity]
    view.worker = running[0] if running else (progress.last_task_identity or None)
    view.parked_since = _parked_since(events, activities)
    trouble = progress.trouble
    if trouble is not None:
        view.task_trouble = f"{trouble.how} on worker {trouble.identity}: {trouble.cause}"
    return view


def phase_from_history(searched: str | None, done: list[str]) -> str | None:
    """The phase after the last one the history says completed, when the search attribute
    is behind it (or absent); otherwise the search attribute's."""
    order = [phase.value for phase in PHASES]
    completed = [order.index(name) for name in done if name in order]
    if not completed:
        return searched
    following = order[min(max(completed) + 1, len(order) - 1)]
    if searched in order and order.index(searched) >= order.index(following):
        return searched
    return following


def _parked_since(events: list[HistoryEvent], activities: list[CompletedActivity]) -> float | None:
    """When admission closed and has not reopened: close_admission's completion when the
    history has it, else (the window runs in one workflow task, recorded when it completes)
    the start of the workflow task after open completed."""
    done = {activity.name for activity in activities}
    if Phase.OPEN.value not in done or Phase.RESUME.value in done:
        return None
    closed = [a.completed_at for a in activities if a.name == Phase.CLOSE_ADMISSION.value]
    if closed:
        return closed[0]
    opened = next(a.completed_at for a in activities if a.name == Phase.OPEN.value)
    starts = [
        event.event_time.seconds + event.event_time.nanos / 1e9
        for event in events
        if event.HasField("workflow_task_started_event_attributes")
    ]
    later = [moment for moment in starts if moment >= opened]
    return later[0] if later else None


def _reported_problems(raw: DescribeWorkflowExecutionResponse) -> list[str]:
    """The server's ``TemporalReportedProblems`` (a keyword list it sets once a workflow task
    keeps failing), when it sets it."""
    fields = raw.workflow_execution_info.search_attributes.indexed_fields
    payload = fields.get(REPORTED_PROBLEMS)
    if payload is None:
        return []
    value = json.loads(payload.data or b"[]")
    return [str(item) for item in (value if isinstance(value, list) else [value])]


async def _failure_of(client: Client, workflow_id: str) -> str | None:
    try:
        await client.get_workflow_handle(workflow_id).result()
    except WorkflowFailureError as exc:  # the closed workflow's failure, as the trainer sees it
        error_type, message = describe_failure(exc)
        return f"{error_type}: {message}"
    return None


def render(view: RunView) -> str:  # noqa: C901, PLR0912 (one branch per section, in order)
    """A few lines for a terminal."""
    lines = [f"run {view.run_id}: supervisor {view.supervisor}"]
    if view.supervisor_failure:
        lines.append(f"  failed: {view.supervisor_failure}")
    if view.status is not None:
        state = view.status.state
        lines.append(
            f"  published {state.published}, skipped {state.skipped}, failed {state.failed}, "
            f"consecutive failures {state.consecutive_failures}, "
            f"queued {view.status.queued_requests}, anchors {state.anchors or 'none'}"
        )
        if view.status.warning is not None:
            lines.append(f"  not being checkpointed: {view.status.warning}")
    elif view.supervisor == "RUNNING":
        lines.append("  (no worker answered the status query: showing server-side state only)")
    if view.workers is not None and not view.workers.present:
        lines.append(f"  {view.workers.absence()}")
    if not view.snapshots:
        lines.append("  no snapshot running")
    for snap in view.snapshots:
        held = f", held by worker {snap.worker}" if snap.worker else ""
        lines.append(
            f"  {snap.workflow_id}: phase {snap.phase or '?'}, running "
            f"{snap.running_for_s:.1f} s{held}"
        )
        if snap.parked_since is not None:
            since = datetime.fromtimestamp(snap.parked_since, UTC).strftime("%H:%M:%S")
            lines.append(
                f"    the run is parked: admission closed since {since} UTC by this snapshot; "
                "its lease reopens it by itself if no worker renews it"
            )
        if snap.task_trouble is not None or snap.task_attempts > 1:
            lines.append(
                f"    workflow task attempt {snap.task_attempts or '?'}; the last one "
                f"{snap.task_trouble or 'did not complete'}"
            )
        if snap.reported_problems:
            lines.append(f"    server reports: {', '.join(snap.reported_problems)}")
        if not snap.pending and snap.phase in _LOCAL_PHASES:
            lines.append(
                f"    {snap.phase} runs in the worker's workflow task (a local activity): its "
                "attempts and failures are in the worker's log"
            )
        for pending in snap.pending:
            beat = (
                f", last heartbeat {pending.last_heartbeat_age_s:.1f} s ago"
                if pending.last_heartbeat_age_s is not None
                else ""
            )
            lines.append(
                f"    waiting on activity {pending.activity} ({pending.state}, "
                f"attempt {pending.attempt}{beat})"
            )
            if pending.last_failure:
                lines.append(f"      last failure: {pending.last_failure}")
    return "\n".join(lines)
