"""What every phase handler gets: the request, its checkpoint's record in the phase ledger,
the open checkpoint's slot, the run service and the snapshot store."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rollsafe.checkpoint.drafts import DraftSlot
from rollsafe.checkpoint.participants import Participants
from rollsafe.checkpoint.phase_ledger import CheckpointRecord, PhaseLedger
from rollsafe.checkpoint.run_service import RunService
from rollsafe.core.gate import AdmissionGate
from rollsafe.core.phases import (
    Phase,
    PhaseRequest,
    PhaseResult,
    PublishedSnapshotInfo,
    SnapshotSpec,
)
from rollsafe.errors import StorageFailed
from rollsafe.snapshot import SnapshotStore


@dataclass(frozen=True)
class PhaseContext:
    request: PhaseRequest
    record: CheckpointRecord
    ledger: PhaseLedger
    drafts: DraftSlot
    run: RunService
    store: SnapshotStore

    @property
    def spec(self) -> SnapshotSpec:
        return self.request.spec

    @property
    def phase(self) -> Phase:
        return self.request.phase

    @property
    def checkpoint_id(self) -> str:
        return self.request.spec.checkpoint_id

    @property
    def gate(self) -> AdmissionGate:
        return self.run.gate

    @property
    def participants(self) -> Participants | None:
        return self.run.participants

    def result(
        self,
        summary: str,
        counts: dict[str, int] | None = None,
        published: PublishedSnapshotInfo | None = None,
    ) -> PhaseResult:
        return PhaseResult(
            phase=self.phase,
            checkpoint_id=self.checkpoint_id,
            summary=summary,
            counts=counts or {},
            published=published,
        )

    def effect(self, happened: bool) -> None:
        self.ledger.count(self.phase, happened)


@contextmanager
def storage_errors(checkpoint_id: str, doing: str) -> Iterator[None]:
    """The snapshot store's disk refused a write (full, read-only, an I/O error): a transient
    StorageFailed naming it; the run's state is untouched and the next snapshot tries again."""
    try:
        yield
    except OSError as exc:
        raise StorageFailed(
            f"checkpoint {checkpoint_id}: {doing} failed: {exc}; nothing was published and "
            "the run's state is untouched"
        ) from exc
