"""``rollsafe inspect RUN``: one human view of a run's checkpointing, built from what the
Temporal server knows (describe and search attributes), so it works with no worker alive;
the supervisor's own status query is added when a worker answers."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel, ConfigDict
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowQueryFailedError,
)
from temporalio.service import RPCError

from rollsafe.core.ids import supervisor_id, task_queue_for
from rollsafe.temporal.failures import describe_failure
from rollsafe.temporal.pollers import WorkerPresence, worker_presence
from rollsafe.temporal.search_attributes import KIND, PHASE
from rollsafe.workflows.models import SupervisorStatus
from rollsafe.workflows.snapshot import PARK_WINDOW
from rollsafe.workflows.supervisor import SnapshotSupervisor

QUERY_TIMEOUT_S = 2.0
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
    phase: str | None
    running_for_s: float
    pending: list[PendingPhase]


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
    view = RunView(run_id=run_id, supervisor="absent")
    view.workers = await worker_presence(client, task_queue or task_queue_for(run_id))
    handle = client.get_workflow_handle_for(SnapshotSupervisor.run, supervisor_id(run_id))
    try:
        description = await handle.describe()
    except RPCError:
        description = None  # no supervisor (snapshots may still be started directly)
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
    view.snapshots = await _running_snapshots(client, run_id)
    return view


async def _running_snapshots(client: Client, run_id: str) -> list[SnapshotView]:
    query = (
        f"RollsafeRunId = '{run_id}' AND WorkflowType = 'RolloutSnapshot' "
        "AND ExecutionStatus = 'Running'"
    )
    now = time.time()
    views = []
    async for execution in client.list_workflows(query):
        description = await client.get_workflow_handle(execution.id).describe()
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
        views.append(
            SnapshotView(
                workflow_id=execution.id,
                kind=attrs.get(KIND),
                phase=attrs.get(PHASE),
                running_for_s=_age(execution.start_time, now) or 0.0,
                pending=pending,
            )
        )
    return views


async def _failure_of(client: Client, workflow_id: str) -> str | None:
    try:
        await client.get_workflow_handle(workflow_id).result()
    except WorkflowFailureError as exc:  # the closed workflow's failure, as the trainer sees it
        error_type, message = describe_failure(exc)
        return f"{error_type}: {message}"
    return None


def render(view: RunView) -> str:
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
    elif view.supervisor == "RUNNING":
        lines.append("  (no worker answered the status query: showing server-side state only)")
    if view.workers is not None and not view.workers.present:
        lines.append(f"  {view.workers.absence()}")
    if not view.snapshots:
        lines.append("  no snapshot running")
    for snap in view.snapshots:
        lines.append(
            f"  {snap.workflow_id}: phase {snap.phase or '?'}, running {snap.running_for_s:.1f} s"
        )
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
