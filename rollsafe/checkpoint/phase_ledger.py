"""The phase ledger: the stored result of each ``(checkpoint, phase)`` (docs/design.md
section 5), as a durable-execution engine keeps a step's output.

Temporal runs an activity at least once, and a timed-out attempt can still be running beside
its retry. So a phase stores its first result here and a repeated call gets it back with
``replayed=True`` without touching anything. One lock per ``(checkpoint, phase)``, not per
checkpoint: a duplicate attempt waits for the first, but resume never waits behind a long phase
of its own checkpoint. A call that may not run (its checkpoint was aborted, already resumed)
is a :class:`~rollsafe.errors.PhaseConflict`.

The ledger also counts each phase's real side effects, so tests can prove "once".
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from rollsafe.checkpoint.record import ABORT, KEYS, CheckpointRecord
from rollsafe.core.gate import Clock
from rollsafe.core.phases import Phase, PhaseResult, SnapshotSpec
from rollsafe.errors import CheckpointRefused, InvalidInput

__all__ = ["ABORT", "CheckpointRecord", "PhaseLedger"]

KEEP_CHECKPOINTS = 16  # records kept for this many recent checkpoint ids


class PhaseLedger:
    """Stored results of one run's recent checkpoints, oldest forgotten first (never the
    open one). ``lock`` is a leaf: held briefly, never across I/O; callers that must check and
    change the gate in one step (close_admission against resume) hold it around both."""

    def __init__(
        self, run_id: str, keep: int = KEEP_CHECKPOINTS, clock: Clock = time.monotonic
    ) -> None:
        self.run_id = run_id
        self.keep = keep
        self.clock = clock  # the admission gate's: a record's idle time is on the same one
        self.lock = threading.RLock()
        self._records: OrderedDict[str, CheckpointRecord] = OrderedDict()
        self._forgotten_seq = 0  # the highest seq of a record forgotten
        self.effects: dict[str, int] = dict.fromkeys(KEYS, 0)

    def record(self, spec: SnapshotSpec, *, pinned: str | None = None) -> CheckpointRecord:
        """``spec``'s record, made on first use; ``pinned``: a checkpoint id never forgotten
        (the open one). A checkpoint not known here whose seq is at or below one forgotten is
        a late attempt of a checkpoint long over (its record is gone, so nothing would stop
        it): refused."""
        if spec.run_id != self.run_id:
            raise InvalidInput(f"checkpoint {spec.checkpoint_id} is not of run {self.run_id}")
        cid = spec.checkpoint_id
        with self.lock:
            record = self._records.get(cid)
            if record is None:
                if spec.seq <= self._forgotten_seq:
                    raise CheckpointRefused(
                        f"checkpoint {cid} is older than the {self.keep} checkpoints this "
                        f"controller remembers (seq {spec.seq} <= {self._forgotten_seq}, "
                        "forgotten): a late attempt of a checkpoint long over"
                    )
                record = self._records[cid] = CheckpointRecord(spec, touched_at=self.clock())
            self._records.move_to_end(cid)
            for old in [c for c in self._records if c not in (cid, pinned)]:
                if len(self._records) <= self.keep:
                    break
                self._forgotten_seq = max(self._forgotten_seq, self._records.pop(old).seq)
            return record

    def get(self, checkpoint_id: str) -> CheckpointRecord | None:
        with self.lock:
            return self._records.get(checkpoint_id)

    @staticmethod
    def stored(record: CheckpointRecord, phase: Phase) -> PhaseResult | None:
        """``phase``'s stored result, as a replay; else None after refusing a phase of an
        aborted checkpoint (resume aside). The caller holds ``record.locks[phase]``."""
        if (stored := record.results.get(phase)) is not None:
            return stored.model_copy(update={"replayed": True})
        if record.aborted is not None and phase is not Phase.RESUME:
            raise CheckpointRefused(
                f"checkpoint {record.checkpoint_id} was aborted: {phase} refused"
            )
        return None

    def begin_phase(self, record: CheckpointRecord) -> None:
        with self.lock:
            record.running += 1
            record.touched_at = self.clock()

    def end_phase(self, record: CheckpointRecord) -> None:
        with self.lock:
            record.running -= 1
            record.touched_at = self.clock()

    def idle_for(self, record: CheckpointRecord) -> float | None:
        """How long no phase of ``record`` has run (None while one runs)."""
        with self.lock:
            return None if record.running else self.clock() - record.touched_at

    def mark_resumed(self, record: CheckpointRecord) -> None:
        with self.lock:
            record.resumed = True

    @staticmethod
    def refuse_if_resumed(record: CheckpointRecord, why: str) -> None:
        """A checkpoint that resumed (or aborted) may not touch the gate or a draft again:
        refused with ``why``. The caller holds :attr:`lock` across this check and what it
        guards."""
        if record.resumed:
            raise CheckpointRefused(f"checkpoint {record.checkpoint_id} {why}")

    def count(self, key: str, happened: bool) -> None:
        """One real side effect of ``key`` (a phase or abort), if it happened."""
        if happened:
            with self.lock:
                self.effects[key] += 1

    def seqs(self) -> list[int]:
        with self.lock:
            return [self._forgotten_seq, *(record.seq for record in self._records.values())]

    def done(self) -> dict[str, list[str]]:
        """Recent checkpoint id -> phases with a stored result."""
        with self.lock:
            return {cid: [p.value for p in r.results] for cid, r in self._records.items()}

    def effect_counts(self) -> dict[str, int]:
        with self.lock:
            return dict(self.effects)
