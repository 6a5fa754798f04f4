"""The open checkpoint: at most one per run, and its draft's life (opened, captured, written
into, published or thrown away).

The draft lives only in the controller's process (the Ray actor outlives checkpoint workers).
A draft thrown away (a failed write, an abort, an admission lease run out) is never published:
its checkpoint's later phases refuse with :class:`~rollsafe.errors.SnapshotLost`, naming why.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from rollsafe.checkpoint.phase_ledger import PhaseLedger
from rollsafe.checkpoint.run_service import RunService
from rollsafe.core.phases import SnapshotSpec
from rollsafe.core.run_state import Capture, Captured
from rollsafe.engine.staging import drop_staged
from rollsafe.errors import CheckpointRefused, SnapshotLost
from rollsafe.faults import fault_point, register
from rollsafe.snapshot import FAULT_POINTS, SnapshotDraft, SnapshotStore

log = logging.getLogger(__name__)
# Inside publish (SnapshotStore's own points), e.g. ROLLSAFE_FAULT=store.before_rename.
STORE_POINTS = register(*(f"store.{point}" for point in FAULT_POINTS))


def store_fault(point: str) -> None:
    """The snapshot store's fault hook: its points as ``store.<point>``."""
    fault_point(f"store.{point}")


@dataclass
class OpenCheckpoint:
    """The checkpoint whose draft is open here."""

    spec: SnapshotSpec
    draft: SnapshotDraft
    lock: threading.Lock = field(default_factory=threading.Lock)  # who may touch the draft
    capture: Capture | None = None  # taken in the park window (capture phase)
    captured: Captured | None = None  # written into the draft, after resume (publish phase)
    released: bool = False  # the capture's hold on the run's deletions has ended
    broken: str | None = None  # why the draft can no longer be published

    def check_usable(self) -> None:
        if self.broken is not None:
            raise SnapshotLost(
                f"checkpoint {self.spec.checkpoint_id}: {self.broken}: take the snapshot again"
            )


class DraftSlot:
    """Holds the open checkpoint. ``ledger.lock`` guards :attr:`open` (a leaf lock: the slot
    never does I/O under it)."""

    def __init__(self, store: SnapshotStore, run: RunService, ledger: PhaseLedger) -> None:
        self.store = store
        self.run = run
        self.ledger = ledger
        self.open: OpenCheckpoint | None = None

    def open_id(self) -> str | None:
        with self.ledger.lock:
            return self.open.spec.checkpoint_id if self.open else None

    def entry(self, checkpoint_id: str) -> OpenCheckpoint | None:
        with self.ledger.lock:
            entry = self.open
            return entry if entry and entry.spec.checkpoint_id == checkpoint_id else None

    def require(self, spec: SnapshotSpec) -> OpenCheckpoint:
        entry = self.entry(spec.checkpoint_id)
        if entry is None:
            raise SnapshotLost(
                f"checkpoint {spec.checkpoint_id} is not open here (not opened, already "
                "published, or the controller restarted): take the snapshot again"
            )
        return entry

    def begin(self, spec: SnapshotSpec) -> OpenCheckpoint:
        """``spec``'s open checkpoint, its draft begun here if it is not open yet; refused
        while another checkpoint is open. The caller holds ``ledger.lock`` (so a resume of
        the same checkpoint cannot slip in between its check and this)."""
        current = self.open
        cid = spec.checkpoint_id
        if current is not None and current.spec.checkpoint_id != cid:
            raise CheckpointRefused(
                f"checkpoint {cid} cannot open: checkpoint {current.spec.checkpoint_id} "
                "is still open (publish or abort it first)"
            )
        if current is None:
            current = self.open = OpenCheckpoint(spec, self.store.begin(spec.kind, cid, spec.seq))
            self.ledger.count("open", True)
        return current

    def closed(self, entry: OpenCheckpoint) -> None:
        """``entry`` is published (or was by an earlier attempt): another may open."""
        with self.ledger.lock:
            if self.open is entry:
                self.open = None

    def discard(self, entry: OpenCheckpoint, why: str) -> None:
        with entry.lock:
            self.discard_locked(entry, why)

    def abandon(self, entry: OpenCheckpoint) -> None:
        """Its admission lease ran out: never publishable."""
        self.discard(entry, entry.broken or "admission lease expired")

    def discard_locked(self, entry: OpenCheckpoint, why: str) -> None:
        """The draft will never be published: thrown away, its capture's hold ended, and the
        run may open another. The caller holds ``entry.lock``."""
        entry.broken = why
        try:
            entry.draft.discard()
        except OSError as exc:  # a read-only disk: the next snapshot's sweep removes it
            log.warning(
                "checkpoint %s: its draft %s could not be removed (%s); the next snapshot "
                "removes it",
                entry.spec.checkpoint_id,
                entry.draft.path,
                exc,
            )
        self.end_capture(entry)
        with self.ledger.lock:
            if (record := self.ledger.get(entry.spec.checkpoint_id)) is not None:
                record.thrown_away = why
        self.closed(entry)

    def end_capture(self, entry: OpenCheckpoint) -> None:
        """The capture's rows are written or never will be: the deletions it held back happen,
        and the staged prefixes leave the live data plane (the snapshot has them, the only
        place a restore reads them from)."""
        if entry.capture is not None and not entry.released:
            entry.released = True
            with self.run.barrier:
                self.run.state.release_capture()
            self.drop_staged()

    def drop_staged(self) -> None:
        if self.run.participants is not None:
            drop_staged(self.run.state.dataplane)
