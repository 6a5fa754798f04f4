"""Reading completed activities, regular and local, and the workflow tasks' trouble out of a
recorded history; the phase `rollsafe inspect` reads from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import TimeoutType, WorkflowTaskFailedCause
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHistory

from rollsafe.cli.inspection import phase_from_history
from rollsafe.core.phases import PHASES
from rollsafe.temporal.history import completed_activities, task_progress

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


def task_event(kind: str, **fields: object) -> HistoryEvent:
    event = HistoryEvent()
    event.event_time.FromSeconds(100)
    getattr(event, f"workflow_task_{kind}_event_attributes").SetInParent()
    for name, value in fields.items():
        attrs = getattr(event, f"workflow_task_{kind}_event_attributes")
        if name == "message":
            attrs.failure.message = value
        else:
            setattr(attrs, name, value)
    return event


def test_task_progress_names_the_worker_whose_task_timed_out_or_failed() -> None:
    started = task_event("started", identity="41@stuck-host")
    timed_out = task_event("timed_out", timeout_type=TimeoutType.TIMEOUT_TYPE_START_TO_CLOSE)
    progress = task_progress([started, timed_out])
    assert progress.last_task_identity == "41@stuck-host"
    assert progress.trouble is not None
    assert (progress.trouble.identity, progress.trouble.how) == ("41@stuck-host", "timed out")
    assert progress.trouble.cause == "start_to_close"

    failed = task_event(
        "failed",
        identity="42@other",
        cause=WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_NON_DETERMINISTIC_ERROR,
        message="activity type mismatch",
    )
    progress = task_progress(
        [started, timed_out, task_event("started", identity="42@other"), failed]
    )
    assert progress.trouble is not None and progress.trouble.how == "failed"
    assert progress.trouble.cause == "NON_DETERMINISTIC_ERROR: activity type mismatch"

    healed = [started, timed_out, task_event("started", identity="43@ok"), task_event("completed")]
    assert task_progress(healed).trouble is None


def test_every_golden_history_ends_without_task_trouble() -> None:
    for path in HISTORIES.glob("*.json"):
        progress = task_progress(history(path.name).events)
        assert progress.trouble is None and progress.last_task_identity, path.name


@pytest.mark.parametrize(
    ("searched", "done", "phase"),
    [
        ("open", ["open"], "close_admission"),  # a worker died in the window: the attribute lags
        ("capture", ["open", "close_admission"], "capture"),  # the attribute is ahead: kept
        (None, [], None),
        (None, ["open", "close_admission", "retire_dropped"], "prepare_envs"),
        ("publish", [p.value for p in PHASES], "publish"),
    ],
)
def test_the_phase_is_the_history_s_when_the_search_attribute_lags(
    searched: str | None, done: list[str], phase: str | None
) -> None:
    assert phase_from_history(searched, done) == phase
