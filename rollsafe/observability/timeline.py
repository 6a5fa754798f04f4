"""A run on one time axis: training steps, snapshots with their park windows, faults and
restores, as data (:class:`Timeline`) and as a picture (:func:`render_timeline`, the demo's
``timeline.png``).

Snapshots and restores come from the Temporal server (:func:`snapshot_spans`,
:func:`restore_spans`): the run's workflows are found by their search attributes and each
one's history gives its times. A snapshot's park window runs from the completion of its
``close_admission`` activity to the completion of its ``resume`` activity: the gate flips
inside those activities. They are local activities (their completion time is the worker's
clock, in their history marker: the window drawn is the real one within a few ms); in a history
of regular activities, the server's event times (at most one round trip more at each end).
Steps and faults come from the caller, who saw them happen.

Listing is eventually consistent on the server: a workflow closed a moment ago may not be
listed yet (the dev server lists it within about a second).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

from rollsafe.core.ids import validate_run_id
from rollsafe.core.phases import Phase
from rollsafe.errors import ExtraNotInstalled, InvalidInput
from rollsafe.temporal.history import completed_activities

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from temporalio.client import Client, WorkflowExecution

SpanKind = Literal["step", "snapshot", "park", "fault", "restore"]
# Lanes from the top; park windows are drawn over their snapshots, in the snapshot lane.
LANES: tuple[SpanKind, ...] = ("step", "snapshot", "restore", "fault")
_CLOSED = {
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED: "completed",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED: "failed",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TIMED_OUT: "timed_out",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED: "canceled",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED: "terminated",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW: "continued_as_new",
}
COLORS = {
    "step": "#4c72b0",
    "park": "#222222",
    "restore": "#8172b2",
    "fault": "#c44e52",
    "published": "#55a868",
    "restored": "#8172b2",
    "skipped": "#999999",
    "running": "#dd8452",
}
_FAILED_COLOR = "#c44e52"  # any other snapshot or restore status: failed, timed out, ...
_MAX_STEP_LABELS = 30  # more steps than this: labels would overlap into noise


class Span(BaseModel):
    """Something that happened between two moments, in seconds since the run started. A fault
    is usually a moment (``end_s == start_s``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: SpanKind
    label: str
    start_s: float = Field(allow_inf_nan=False)
    end_s: float = Field(allow_inf_nan=False)
    status: str = ""  # snapshot: published/skipped/failed/...; restore: restored/failed/...

    @model_validator(mode="after")
    def _ordered(self) -> Span:
        if self.end_s < self.start_s:
            raise ValueError(f"{self.kind} {self.label!r} ends ({self.end_s}) before it starts")
        return self


class Timeline(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spans: list[Span] = Field(default_factory=list)
    title: str = ""


# ---- from the Temporal server ------------------------------------------------------------


async def snapshot_spans(client: Client, run_id: str, t0_unix: float) -> list[Span]:
    """One ``snapshot`` span per RolloutSnapshot execution of the run (start -> close, status
    the outcome's: published, skipped, failed; or how it closed otherwise: terminated, ...;
    ``running`` ends now) and one ``park`` span inside it (see the module doc), ordered by
    start."""
    spans: list[Span] = []
    async for execution, events in _histories(client, run_id, "RolloutSnapshot"):
        seq = execution.id.rsplit("/", 1)[-1]
        start, end, closed = _bounds(events)
        status = await _status(client, events[-1]) if closed == "completed" else closed
        spans.append(_span("snapshot", f"snapshot {seq}", start, end, status, t0_unix))
        park = _park(events, end)
        if park is not None:
            spans.append(_span("park", f"park {seq}", *park, status, t0_unix))
    return sorted(spans, key=lambda s: (s.start_s, s.kind != "snapshot"))


async def restore_spans(client: Client, run_id: str, t0_unix: float) -> list[Span]:
    """One ``restore`` span per RestoreRun execution of the run, status ``restored`` when it
    completed, else how it closed (``failed``, ...) or ``running``."""
    spans = []
    async for execution, events in _histories(client, run_id, "RestoreRun"):
        start, end, closed = _bounds(events)
        status = "restored" if closed == "completed" else closed
        label = f"restore {execution.id.rsplit('/', 1)[-1]}"
        spans.append(_span("restore", label, start, end, status, t0_unix))
    return sorted(spans, key=lambda s: s.start_s)


async def _histories(
    client: Client, run_id: str, workflow_type: str
) -> AsyncIterator[tuple[WorkflowExecution, list[HistoryEvent]]]:
    # The run id goes into a visibility query: only ids that cannot close the quote pass.
    query = f"RollsafeRunId = '{validate_run_id(run_id)}' AND WorkflowType = '{workflow_type}'"
    async for execution in client.list_workflows(query):
        handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
        history = await handle.fetch_history()
        if history.events:
            yield execution, list(history.events)


def _seconds(event: HistoryEvent) -> float:
    return event.event_time.seconds + event.event_time.nanos / 1e9


def _bounds(events: list[HistoryEvent]) -> tuple[float, float, str]:
    """Start, end (now while running) and how the execution closed (``running``: not yet)."""
    closed = _CLOSED.get(events[-1].event_type)
    end = _seconds(events[-1]) if closed is not None else time.time()
    return _seconds(events[0]), end, closed or "running"


async def _status(client: Client, completed: HistoryEvent) -> str:
    """The snapshot outcome's status (published, skipped, failed): the workflow result."""
    payloads = completed.workflow_execution_completed_event_attributes.result.payloads
    [outcome] = await client.data_converter.decode(payloads)
    if isinstance(outcome, BaseModel):
        outcome = outcome.model_dump()
    return str(outcome.get("status", "completed")) if isinstance(outcome, dict) else "completed"


def _park(events: list[HistoryEvent], end: float) -> tuple[float, float] | None:
    """close_admission completed -> resume completed (``end`` if resume never completed);
    None when admission never closed."""
    completed: dict[str, float] = {}
    for done in completed_activities(events):
        completed.setdefault(done.name, done.completed_at)
    closed_at = completed.get(Phase.CLOSE_ADMISSION.value)
    if closed_at is None:
        return None
    return closed_at, max(closed_at, completed.get(Phase.RESUME.value, end))


def _span(
    kind: SpanKind, label: str, start: float, end: float, status: str, t0_unix: float
) -> Span:
    return Span(kind=kind, label=label, start_s=start - t0_unix, end_s=end - t0_unix, status=status)


# ---- the picture -------------------------------------------------------------------------


def render_timeline(timeline: Timeline, path: Path) -> None:
    """Draw ``timeline`` as a PNG at ``path``: one lane per kind, park windows over their
    snapshot, faults as markers with their labels, x in seconds. Written to a temporary file
    beside ``path`` and renamed, so ``path`` is never half a picture. An empty timeline is
    refused (``InvalidInput``): a run that recorded nothing should fail loudly, not draw
    an empty chart."""
    if not timeline.spans:
        raise InvalidInput(f"timeline for {path} has no spans: nothing to draw")
    try:
        import matplotlib
    except ImportError:
        raise ExtraNotInstalled("drawing timeline.png (matplotlib)", "plots") from None

    matplotlib.use("Agg")  # no display: the demo runs headless
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 1.2 + 0.7 * len(LANES)), dpi=120)
    ax = fig.subplots()
    lanes = {kind: len(LANES) - 1 - row for row, kind in enumerate(LANES)}
    first = min(0.0, *(s.start_s for s in timeline.spans))
    last = max(s.end_s for s in timeline.spans)
    least = max(last - first, 1e-3) / 400  # a span shorter than this is drawn this wide
    by_kind = {kind: [s for s in timeline.spans if s.kind == kind] for kind in (*LANES, "park")}
    for kind in ("step", "snapshot", "restore"):
        _bars(ax, by_kind[kind], lanes[kind], 0.6, least, labels=kind != "snapshot")
    _bars(ax, by_kind["park"], lanes["snapshot"], 0.25, least, labels=False)
    _faults(ax, by_kind["fault"], lanes["fault"])
    ax.set_yticks(list(lanes.values()), list(lanes))
    ax.set_ylim(-0.7, len(LANES) - 0.3)
    ax.set_xlim(first - least * 4, last + (last - first) * 0.03 + least * 4)
    ax.set_xlabel("seconds since the run started")
    ax.grid(axis="x", alpha=0.3)
    if timeline.title:
        ax.set_title(timeline.title)
    _legend(ax, timeline.spans)
    fig.tight_layout()
    _save(fig, path)


def _color(span: Span) -> str:
    if span.kind in ("snapshot", "restore"):
        return COLORS.get(span.status, _FAILED_COLOR)
    return COLORS[span.kind]


def _bars(
    ax: Axes, spans: Sequence[Span], y: int, height: float, least: float, *, labels: bool
) -> None:
    if not spans:
        return
    widths = [max(s.end_s - s.start_s, least) for s in spans]
    ax.barh(
        [y] * len(spans),
        widths,
        left=[s.start_s for s in spans],
        height=height,
        color=[_color(s) for s in spans],
        edgecolor="white",
        linewidth=0.5,
    )
    if not labels or (spans[0].kind == "step" and len(spans) > _MAX_STEP_LABELS):
        return
    for span, width in zip(spans, widths, strict=True):
        ax.text(span.start_s + width / 2, y, span.label, ha="center", va="center", fontsize=7)


def _faults(ax: Axes, faults: Sequence[Span], y: int) -> None:
    for fault in faults:
        ax.axvline(fault.start_s, color=COLORS["fault"], linestyle=":", linewidth=1, alpha=0.7)
        if fault.end_s > fault.start_s:  # a fault with a duration (e.g. a worker down)
            ax.barh(
                y,
                fault.end_s - fault.start_s,
                left=fault.start_s,
                height=0.3,
                color=COLORS["fault"],
                alpha=0.5,
            )
        ax.plot([fault.start_s], [y], marker="X", color=COLORS["fault"], markersize=9)
        ax.annotate(
            fault.label,
            (fault.start_s, y),
            xytext=(4, 8),
            textcoords="offset points",
            fontsize=7,
            rotation=20,
        )


def _legend(ax: Axes, spans: Sequence[Span]) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [Patch(color=COLORS["step"], label="train step")]
    statuses = sorted({s.status for s in spans if s.kind == "snapshot"})
    handles += [Patch(color=_color(_probe(st)), label=f"snapshot: {st}") for st in statuses]
    handles.append(Patch(color=COLORS["park"], label="park (admission closed)"))
    handles.append(Patch(color=COLORS["restore"], label="restore"))
    handles.append(Line2D([], [], color=COLORS["fault"], marker="X", linestyle=":", label="fault"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def _probe(status: str) -> Span:
    return Span(kind="snapshot", label="", start_s=0.0, end_s=0.0, status=status)


def _save(fig: Any, path: Path) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            fig.savefig(out, format="png")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
