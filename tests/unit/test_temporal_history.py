"""Reading completed activities, regular and local, out of a recorded history."""

from __future__ import annotations

import json
from pathlib import Path

from temporalio.client import WorkflowHistory

from rollsafe.core.phases import PHASES
from rollsafe.temporal.history import completed_activities

HISTORIES = Path(__file__).resolve().parents[1] / "histories"


def history(name: str) -> WorkflowHistory:
    text = (HISTORIES / name).read_text()
    started = json.loads(text)["events"][0]["workflowExecutionStartedEventAttributes"]
    return WorkflowHistory.from_json(started["workflowId"], text)


def test_a_history_with_local_and_regular_phases_lists_each_once_in_order() -> None:
    # Recorded with participants=False: the five participant phases are local activities.
    done = completed_activities(history("snapshot_published_without_participants.json").events)
    assert [a.name for a in done] == [p.value for p in PHASES]
    local = {a.name for a in done if a.local}
    assert local == {"retire_dropped", "prepare_envs", "drain", "cut_generation", "commit_envs"}
    assert all(a.attempt == 1 and a.identity for a in done)
    times = [a.completed_at for a in done]
    # Local activities carry the worker's completion time, within the run's span.
    assert min(times) > 1.7e9 and max(times) - min(times) < 60


def test_a_history_of_regular_activities_has_no_local_ones() -> None:
    done = completed_activities(history("snapshot_published.json").events)
    assert [a.name for a in done] == [p.value for p in PHASES]
    assert not any(a.local for a in done)
