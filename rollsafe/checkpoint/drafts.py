"""The open checkpoint: at most one per run, and its draft's life (opened, captured, written
into, published or discarded), kept on the checkpoint's record
(rollsafe.checkpoint.record).

The draft lives only in the controller's process (the Ray actor outlives checkpoint workers).
A draft discarded (a failed write, an abort, an admission lease run out, a checkpoint no
phase called on for its lease) is never published: its checkpoint's later phases refuse with
:class:`~rollsafe.errors.SnapshotLost`, naming why.
"""

from __future__ import annotations

import logging

from rollsafe.checkpoint.phase_ledger import PhaseLedger
from rollsafe.checkpoint.record import CheckpointRecord
from rollsafe.checkpoint.run_service import RunService
from rollsafe.core.gate import AdmissionGate
from rollsafe.engine.staging import drop_staged
from rollsafe.errors import CheckpointBusy, SnapshotLost
from rollsafe.faults import fault_point, register
from rollsafe.snapshot import FAULT_POINTS, SnapshotStore

log = logging.getLogger(__name__)
# Inside publish (SnapshotStore's own points), e.g. ROLLSAFE_FAULT=store.before_rename.
STORE_POINTS = register(*(f"store.{point}" for point in FAULT_POINTS))


def store_fault(point: str) -> None:
    """The snapshot store's fault hook: its points as ``store.<point>``."""
    fault_point(f"store.{point}")


class DraftSlot:
    """Holds the open checkpoint's record. ``ledger.lock`` guards :attr:`open` (a leaf lock:
    the slot never does I/O under it)."""

    def __init__(self, store: SnapshotStore, run: RunService, ledger: PhaseLedger) -> None:
        self.store = store
        self.run = run
        self.ledger = ledger
        self.open: CheckpointRecord | None = None

    def open_id(self) -> str | None:
        with self.ledger.lock:
            return self.open.checkpoint_id if self.open else None

    def entry(self, checkpoint_id: str) -> CheckpointRecord | None:
        """The record of ``checkpoint_id`` if its draft is the open one."""
        with self.ledger.lock:
            record = self.open
            return record if record and record.checkpoint_id == checkpoint_id else None

    def require(self, record: CheckpointRecord) -> CheckpointRecord:
        if self.entry(record.checkpoint_id) is None:
            record.check_usable()  # discarded: say why
            raise SnapshotLost(
                f"checkpoint {record.checkpoint_id} is not open here (not opened, already "
                "published, or the controller restarted): take the snapshot again"
            )
        return record

    def reclaim(self, gate: AdmissionGate, opening: CheckpointRecord) -> None:
        """Throw away the open draft of another checkpoint that can never be published: its
        admission lease ran out, or no phase of it ran for its lease while it did not hold
        admission closed (its workflow was terminated between open and close_admission, or
        after resume): without this, every later open would be refused for good."""
        with self.ledger.lock:
            stale = self.open
        if stale is None or stale is opening:
            return
        if gate.expired(stale.checkpoint_id) is not None:
            self.discard(stale, stale.discarded or "admission lease expired")
            return
        idle_s = self.ledger.idle_for(stale)
        if gate.holder != stale.checkpoint_id and idle_s is not None and idle_s > stale.lease_s:
            why = (
                f"no phase of it ran for {idle_s:.1f} s, past its {stale.lease_s:g} s lease "
                "(its workflow ended without resume or abort?)"
            )
            log.warning(
                "checkpoint %s: draft reclaimed by %s: %s",
                stale.checkpoint_id,
                opening.checkpoint_id,
                why,
                extra={"checkpoint_id": stale.checkpoint_id},
            )
            self.discard(stale, why)

    def begin(self, record: CheckpointRecord, lease_s: float) -> CheckpointRecord:
        """``record``'s draft begun here if it is not open yet; refused while another
        checkpoint is open (:class:`~rollsafe.errors.CheckpointBusy`: it ends, or lapses and is
        reclaimed). The caller holds ``ledger.lock`` (so a resume of the same checkpoint
        cannot slip in between its check and this)."""
        current = self.open
        cid = record.checkpoint_id
        if current is not None and current is not record:
            raise CheckpointBusy(
                f"checkpoint {cid} cannot open: checkpoint {current.checkpoint_id} "
                f"is still open (it publishes, is aborted, or lapses {current.lease_s:g} s "
                "after its last phase)"
            )
        if current is None:
            spec = record.spec
            record.check_usable()
            record.draft = self.store.begin(spec.kind, cid, spec.seq, sweep=False)
            record.lease_s = lease_s
            self.open = record
            self.ledger.count("open", True)
        return record

    def closed(self, record: CheckpointRecord) -> None:
        """``record``'s draft is published (or was by an earlier attempt): another may open."""
        with self.ledger.lock:
            if self.open is record:
                self.open = None
        record.let_go()

    def discard(self, record: CheckpointRecord, why: str) -> None:
        with record.draft_lock:
            self.discard_locked(record, why)

    def discard_locked(self, record: CheckpointRecord, why: str) -> None:
        """The draft will never be published: removed, its capture's hold ended, and the
        run may open another. The caller holds ``record.draft_lock``."""
        with self.ledger.lock:
            record.discarded = why
        if record.draft is not None:
            try:
                record.draft.discard()
            except OSError as exc:  # a read-only disk: the next snapshot's sweep removes it
                log.warning(
                    "checkpoint %s: its draft %s could not be removed (%s); the next "
                    "snapshot removes it",
                    record.checkpoint_id,
                    record.draft.path,
                    exc,
                )
        self.end_capture(record)
        self.closed(record)

    def end_capture(self, record: CheckpointRecord) -> None:
        """The capture's rows are written or never will be: the deletions it held back happen
        (outside the barrier), and the staged prefixes leave the live data plane (the snapshot
        has them, the only place a restore reads them from)."""
        if record.capture is not None and not record.released:
            record.released = True
            with self.run.barrier:
                state = self.run.state
                state.release_capture()
                due = state.take_due_deletes()
            state.delete_rows(due)
            self.drop_staged()

    def drop_staged(self) -> None:
        if self.run.participants is not None:
            drop_staged(self.run.state.dataplane)
