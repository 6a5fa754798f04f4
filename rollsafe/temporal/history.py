"""What a workflow's history says: the activities that completed, regular and local alike,
and how its workflow tasks fare (``task_progress``: the worker holding it, the newest task
that failed or timed out).

A regular activity is three events (scheduled, started with its worker's identity, completed);
a local activity is one ``MarkerRecorded`` event (marker ``core_local_activity``) whose ``data``
detail is the SDK core's JSON record of it (activity type, attempt, completion time on the
worker's clock), recorded when the workflow task that ran it completed: its worker is that
task's. The park window's phases are local activities (workflows/snapshot.py), so a reader of
phase times must read both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from temporalio.api.enums.v1 import TimeoutType, WorkflowTaskFailedCause
from temporalio.api.history.v1 import HistoryEvent

LOCAL_ACTIVITY_MARKER = "core_local_activity"
_CAUSE_PREFIX = "WORKFLOW_TASK_FAILED_CAUSE_"


@dataclass(frozen=True)
class CompletedActivity:
    name: str
    attempt: int
    completed_at: float  # unix seconds: the server's event time, or the worker's for a local one
    identity: str  # the worker's (the SDK's default is ``pid@host``)
    local: bool


def completed_activities(events: Iterable[HistoryEvent]) -> list[CompletedActivity]:
    """Every completed activity in history order (an activity retried to completion once)."""
    names: dict[int, str] = {}
    started: dict[int, tuple[int, str]] = {}  # scheduled event id -> attempt, identity
    task_identity = ""
    done: list[CompletedActivity] = []
    for event in events:
        if event.HasField("activity_task_scheduled_event_attributes"):
            scheduled_event = event.activity_task_scheduled_event_attributes
            names[event.event_id] = scheduled_event.activity_type.name
        elif event.HasField("activity_task_started_event_attributes"):
            attributes = event.activity_task_started_event_attributes
            started[attributes.scheduled_event_id] = (attributes.attempt, attributes.identity)
        elif event.HasField("activity_task_completed_event_attributes"):
            scheduled = event.activity_task_completed_event_attributes.scheduled_event_id
            attempt, identity = started.get(scheduled, (0, ""))
            name = names.get(scheduled, "")
            done.append(CompletedActivity(name, attempt, _seconds(event), identity, local=False))
        elif event.HasField("workflow_task_completed_event_attributes"):
            task_identity = event.workflow_task_completed_event_attributes.identity
        elif (local := _local_activity(event, task_identity)) is not None:
            done.append(local)
    return done


def _local_activity(event: HistoryEvent, identity: str) -> CompletedActivity | None:
    if not event.HasField("marker_recorded_event_attributes"):
        return None
    marker = event.marker_recorded_event_attributes
    if marker.marker_name != LOCAL_ACTIVITY_MARKER or marker.HasField("failure"):
        return None
    payloads = marker.details["data"].payloads
    if not payloads:
        return None
    data = json.loads(payloads[0].data)
    complete = data.get("complete_time") or {}
    completed_at = complete.get("seconds", 0) + complete.get("nanos", 0) / 1e9
    return CompletedActivity(
        name=str(data.get("activity_type", "")),
        attempt=int(data.get("attempt", 0)),
        completed_at=completed_at or _seconds(event),
        identity=identity,
        local=True,
    )


def _seconds(event: HistoryEvent) -> float:
    return event.event_time.seconds + event.event_time.nanos / 1e9


@dataclass(frozen=True)
class WorkflowTaskTrouble:
    """The newest workflow task that did not complete: who had it, and how it ended."""

    identity: str  # the worker that started it (a timed-out task names no other)
    how: str  # "failed" | "timed out"
    cause: str  # the failure's cause and message, or the timeout's kind
    at: float  # unix seconds


@dataclass(frozen=True)
class TaskProgress:
    """Where a workflow's history stands: the last worker that started a workflow task (the
    park window's phases run inside one), when that task started, and the newest task that
    failed or timed out (``None`` once a later task completed)."""

    last_task_identity: str
    last_task_started_at: float | None
    trouble: WorkflowTaskTrouble | None


def task_progress(events: Iterable[HistoryEvent]) -> TaskProgress:
    """Read from a workflow's history (in order)."""
    identity, started_at, trouble = "", None, None
    for event in events:
        if event.HasField("workflow_task_started_event_attributes"):
            identity = event.workflow_task_started_event_attributes.identity
            started_at = _seconds(event)
        elif event.HasField("workflow_task_completed_event_attributes"):
            trouble = None
        elif event.HasField("workflow_task_failed_event_attributes"):
            failed = event.workflow_task_failed_event_attributes
            cause = WorkflowTaskFailedCause.Name(failed.cause).removeprefix(_CAUSE_PREFIX)
            why = f"{cause}: {failed.failure.message}" if failed.failure.message else cause
            trouble = WorkflowTaskTrouble(
                failed.identity or identity, "failed", why, _seconds(event)
            )
        elif event.HasField("workflow_task_timed_out_event_attributes"):
            kind = event.workflow_task_timed_out_event_attributes.timeout_type
            why = TimeoutType.Name(kind).removeprefix("TIMEOUT_TYPE_").lower()
            trouble = WorkflowTaskTrouble(identity, "timed out", why, _seconds(event))
    return TaskProgress(identity, started_at, trouble)
