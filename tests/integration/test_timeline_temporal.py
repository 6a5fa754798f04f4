"""The timeline's snapshot, park and restore spans, read back from a real Temporal dev server's
histories after real snapshot and restore workflows ran."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rollsafe.core.ids import restore_workflow_id
from rollsafe.core.phases import RestoreRequest
from rollsafe.faults import arm, disarm_all
from rollsafe.observability.timeline import (
    Span,
    Timeline,
    render_timeline,
    restore_spans,
    snapshot_spans,
)
from rollsafe.testing.waiting import eventually_async
from rollsafe.workflows.restore import RestoreRun

if TYPE_CHECKING:
    from tests.integration.conftest import WorkflowHarness


async def _listed(
    read: Callable[[], Awaitable[list[Span]]], count: int, timeout_s: float = 10.0
) -> list[Span]:
    """Visibility (list by search attribute) is eventually consistent on the server: the
    spans once at least ``count`` are listed."""

    async def listed() -> list[Span] | None:
        spans = await read()
        return spans if len(spans) >= count else None

    spans: list[Span] | None = await eventually_async(
        listed, timeout_s, what=f"{count} span(s) listed"
    )
    assert spans is not None
    return spans


async def test_snapshot_and_park_spans_from_workflow_histories(
    harness: WorkflowHarness, tmp_path: Path
) -> None:
    t0 = time.time()
    async with harness.worker():
        published = await harness.snapshot(1)
        arm("phase.capture.before", "raise")  # every attempt: the snapshot fails, then resumes
        failed = await harness.snapshot(2)
        disarm_all()
        restore = RestoreRequest(run_id=harness.run_id, restore_id="r1")
        await harness.client.execute_workflow(
            RestoreRun.run,
            restore,
            id=restore_workflow_id(harness.run_id, "r1"),
            task_queue=harness.task_queue,
        )
    elapsed = time.time() - t0
    assert (published.status, failed.status) == ("published", "failed")

    spans = await _listed(lambda: snapshot_spans(harness.client, harness.run_id, t0), 4)
    assert [(s.kind, s.label, s.status) for s in spans] == [
        ("snapshot", "snapshot 1", "published"),
        ("park", "park 1", "published"),
        ("snapshot", "snapshot 2", "failed"),
        ("park", "park 2", "failed"),
    ]
    snap1, park1, snap2, park2 = spans
    for snapshot, park in ((snap1, park1), (snap2, park2)):
        assert 0 <= snapshot.start_s < park.start_s < park.end_s <= snapshot.end_s <= elapsed
    assert snap1.end_s <= snap2.start_s  # one after the other, in order
    # Publish runs after resume: the published snapshot closes after its park ends.
    assert park1.end_s < snap1.end_s

    [restored] = await _listed(lambda: restore_spans(harness.client, harness.run_id, t0), 1)
    assert (restored.kind, restored.label, restored.status) == ("restore", "restore r1", "restored")
    assert snap2.end_s <= restored.start_s < restored.end_s <= elapsed

    out = tmp_path / "timeline.png"
    render_timeline(Timeline(spans=[*spans, restored]), out)
    assert out.read_bytes().startswith(b"\x89PNG")


async def test_only_the_runs_own_snapshots_are_listed(
    harness: WorkflowHarness, tmp_path: Path
) -> None:
    other = type(harness)(harness.client, tmp_path / "other")  # a second run, same server
    async with harness.worker(), other.worker():
        await harness.snapshot(1)
        await other.snapshot(1)
        await other.snapshot(2)
    mine = await _listed(lambda: snapshot_spans(harness.client, harness.run_id, 0.0), 2)
    theirs = await _listed(lambda: snapshot_spans(harness.client, other.run_id, 0.0), 4)
    assert [s.label for s in mine] == ["snapshot 1", "park 1"]
    assert [s.label for s in theirs] == ["snapshot 1", "park 1", "snapshot 2", "park 2"]
    assert await snapshot_spans(harness.client, "no-such-run", 0.0) == []
