"""The timeline's models and picture: a PNG is written atomically, an empty timeline is refused
with a clear message, and the history parsing finds the park window (the Temporal side is in
tests/integration/test_timeline_temporal.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from pydantic import ValidationError
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

from rollsafe.errors import InvalidInput
from rollsafe.observability.timeline import Span, Timeline, _bounds, _park, render_timeline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def a_run() -> Timeline:
    steps = [Span(kind="step", label=f"step {k}", start_s=k, end_s=k + 0.9) for k in range(6)]
    return Timeline(
        title="demo run",
        spans=[
            *steps,
            Span(kind="snapshot", label="snapshot 1", start_s=1.2, end_s=1.6, status="published"),
            Span(kind="park", label="park 1", start_s=1.25, end_s=1.4, status="published"),
            Span(kind="snapshot", label="snapshot 2", start_s=2.5, end_s=2.7, status="skipped"),
            Span(kind="park", label="park 2", start_s=2.55, end_s=2.6, status="skipped"),
            Span(kind="snapshot", label="snapshot 3", start_s=3.1, end_s=3.3, status="failed"),
            Span(kind="fault", label="kill worker", start_s=3.2, end_s=3.2),
            Span(kind="fault", label="engine down", start_s=3.9, end_s=4.4),
            Span(kind="restore", label="restore r1", start_s=4.4, end_s=4.8, status="restored"),
        ],
    )


def test_renders_a_png_atomically(tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    render_timeline(a_run(), out)
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 20_000
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.png"]  # no temporary left
    render_timeline(Timeline(spans=a_run().spans[:2]), out)  # replaced whole, never appended
    assert out.read_bytes().startswith(PNG_SIGNATURE) and out.read_bytes() != data


def test_many_steps_and_instant_spans_still_render(tmp_path: Path) -> None:
    spans = [Span(kind="step", label=f"s{k}", start_s=k / 10, end_s=k / 10) for k in range(200)]
    render_timeline(Timeline(spans=spans), tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes().startswith(PNG_SIGNATURE)


def test_an_empty_timeline_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    with pytest.raises(InvalidInput, match="no spans: nothing to draw"):
        render_timeline(Timeline(spans=[]), out)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        render_timeline(a_run(), tmp_path / "missing-dir" / "timeline.png")
    assert list(tmp_path.iterdir()) == []


def test_models_refuse_bad_spans() -> None:
    with pytest.raises(ValidationError, match="ends"):
        Span(kind="step", label="s", start_s=2.0, end_s=1.0)
    with pytest.raises(ValidationError):
        Span(kind="checkpoint", label="s", start_s=0.0, end_s=1.0)
    with pytest.raises(ValidationError):
        Span(kind="step", label="s", start_s=0.0, end_s=float("inf"))
    with pytest.raises(ValidationError):
        Timeline.model_validate({"spans": [], "colour": "red"})
    again = Timeline.model_validate_json(a_run().model_dump_json())
    assert again == a_run()


def event(event_id: int, kind: EventType.ValueType, at: float, **attributes: Any) -> HistoryEvent:
    stamp = Timestamp(seconds=int(at), nanos=round((at - int(at)) * 1e9))
    return HistoryEvent(event_id=event_id, event_type=kind, event_time=stamp, **attributes)


def scheduled(event_id: int, at: float, name: str) -> HistoryEvent:
    return event(
        event_id,
        EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
        at,
        activity_task_scheduled_event_attributes={"activity_type": {"name": name}},
    )


def completed(event_id: int, at: float, scheduled_id: int) -> HistoryEvent:
    return event(
        event_id,
        EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
        at,
        activity_task_completed_event_attributes={"scheduled_event_id": scheduled_id},
    )


def history(resume: bool, closed: bool) -> list[HistoryEvent]:
    events = [
        event(1, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED, 100.0),
        scheduled(2, 100.1, "open"),
        completed(3, 100.2, 2),
        scheduled(4, 100.3, "close_admission"),
        completed(5, 100.5, 4),
        scheduled(6, 100.6, "resume"),
    ]
    if resume:
        events.append(completed(7, 101.25, 6))
    if closed:
        events.append(event(8, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED, 102.0))
    return events


def test_the_park_window_runs_from_close_to_resume_or_to_the_end() -> None:
    assert _park(history(resume=True, closed=True), 102.0) == pytest.approx((100.5, 101.25))
    start, end, how = _bounds(history(resume=False, closed=True))
    assert (start, end, how) == (pytest.approx(100.0), pytest.approx(102.0), "failed")  # type: ignore[comparison-overlap]  # pytest types an Approx as unequal to a float
    assert _park(history(resume=False, closed=True), end) == pytest.approx((100.5, 102.0))
    assert _bounds(history(resume=False, closed=False))[2] == "running"
    never_closed = history(resume=False, closed=True)[:3]
    assert _park(never_closed, 102.0) is None
