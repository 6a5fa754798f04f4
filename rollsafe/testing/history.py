"""What a workflow's history says about the activities that ran it (for tests that kill
workers and check who finished what)."""

from __future__ import annotations

from typing import Any

from temporalio.client import WorkflowHandle


async def completed_attempts(handle: WorkflowHandle[Any, Any]) -> dict[str, tuple[int, int]]:
    """Activity name -> (attempt, worker pid) of the attempt that completed it. History keeps
    only an activity's last attempt, with the identity of its worker (the SDK's default
    identity is ``pid@host``)."""
    names: dict[int, str] = {}
    attempts: dict[str, tuple[int, int]] = {}
    async for event in handle.fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes"):
            scheduled = event.activity_task_scheduled_event_attributes
            names[event.event_id] = scheduled.activity_type.name
        elif event.HasField("activity_task_started_event_attributes"):
            started = event.activity_task_started_event_attributes
            pid = int(started.identity.split("@")[0])
            attempts[names[started.scheduled_event_id]] = (started.attempt, pid)
    return attempts
