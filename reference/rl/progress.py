"""The demo's live view of its snapshots and its ``timeline.png``.

Snapshots are Temporal workflows, most of them started by the supervisor on its timer, so the
demo learns of them where an operator would: from the server
(:mod:`rollsafe.observability.timeline` reads each one's history). A watcher prints every
snapshot once it has closed, with its park window (admission closed to reopened) and total
time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from rollsafe.observability.timeline import (
    Span,
    Timeline,
    render_timeline,
    restore_spans,
    snapshot_spans,
)
from rollsafe.temporal.connect import ConnectionSettings, connect

TIMELINE_PNG = "timeline.png"


class SnapshotWatch:
    """Prints each of the run's snapshots once, when it has closed; polls every ``every_s``."""

    def __init__(
        self,
        settings: ConnectionSettings,
        run_id: str,
        t0_unix: float,
        say: Callable[[str], None],
        every_s: float = 2.0,
    ) -> None:
        self.settings, self.run_id, self.t0_unix = settings, run_id, t0_unix
        self.say, self.every_s = say, every_s
        self.parks: list[float] = []  # seconds, of every closed snapshot that parked
        self._shown: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="snapshot-watch", daemon=True)

    def __enter__(self) -> SnapshotWatch:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _main(self) -> None:
        asyncio.run(self._watch())

    async def _watch(self) -> None:
        client = await connect(self.settings)
        while not self._stop.is_set():
            try:
                self._show(await snapshot_spans(client, self.run_id, self.t0_unix))
            except Exception as exc:  # a view only: a failed poll is retried, never fatal
                self.say(f"[watch] could not read the snapshots: {exc}")
            await asyncio.to_thread(self._stop.wait, self.every_s)

    def _show(self, spans: list[Span]) -> None:
        parks = {s.label.split(" ", 1)[1]: s for s in spans if s.kind == "park"}
        for span in spans:
            if span.kind != "snapshot" or span.status == "running" or span.label in self._shown:
                continue
            self._shown.add(span.label)
            park = parks.get(span.label.split(" ", 1)[1])
            parked = "never parked"
            if park is not None:
                self.parks.append(park.end_s - park.start_s)
                parked = f"parked {park.end_s - park.start_s:.2f}s"
            total = span.end_s - span.start_s
            self.say(f"[snapshot] {span.label} {span.status}: {parked} of {total:.2f}s")


def write_timeline(
    settings: ConnectionSettings,
    run_id: str,
    t0_unix: float,
    seen: list[Span],
    out: Path,
    title: str,
) -> Path:
    """``timeline.png`` from what the demo saw (steps, faults) and the server's snapshots and
    restores."""

    async def from_server() -> list[Span]:
        client = await connect(settings)
        snapshots = await snapshot_spans(client, run_id, t0_unix)
        return [*snapshots, *await restore_spans(client, run_id, t0_unix)]

    spans = [*seen, *asyncio.run(from_server())]
    path = out / TIMELINE_PNG
    render_timeline(Timeline(spans=spans, title=title), path)
    return path
