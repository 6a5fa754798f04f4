"""What a workflow's history says about the activities that ran it (for tests that kill
workers and check who finished what)."""

from __future__ import annotations

from typing import Any

from temporalio.client import WorkflowHandle

from rollsafe.temporal.history import completed_activities


async def completed_attempts(handle: WorkflowHandle[Any, Any]) -> dict[str, tuple[int, int]]:
    """Activity name -> (attempt, worker pid) of the attempt that completed it, regular or local
    (a local activity's worker is that of the workflow task that recorded it). History keeps
    only an activity's last attempt; the SDK's default identity is ``pid@host``."""
    events = [event async for event in handle.fetch_history_events()]
    return {
        done.name: (done.attempt, int(done.identity.split("@")[0]))
        for done in completed_activities(events)
    }
