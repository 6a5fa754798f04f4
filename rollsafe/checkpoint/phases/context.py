"""What every phase handler gets (the request, its checkpoint's record, the open
checkpoint's slot, the run service and the snapshot store), and what the participant phases
share: the engines' deadline, a refusal of a resumed checkpoint, short log lists."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from rollsafe.checkpoint.drafts import DraftSlot
from rollsafe.checkpoint.participants import Participants
from rollsafe.checkpoint.phase_ledger import PhaseLedger
from rollsafe.checkpoint.record import CheckpointRecord
from rollsafe.checkpoint.run_service import RunService
from rollsafe.core.gate import AdmissionGate
from rollsafe.core.phases import (
    Phase,
    PhaseRequest,
    PhaseResult,
    PublishedSnapshotInfo,
    SnapshotSpec,
)
from rollsafe.core.states import RestoreLevel
from rollsafe.env.protocol import EpisodeRef
from rollsafe.errors import CheckpointSpent, EnvRefused, StorageFailed
from rollsafe.snapshot import SnapshotStore

# The restore level of a parked episode's group (the ledger's, looked up by the controller):
# what its snapshot must hold. ``prefix``: the episode and its cut call's prefix; ``turn``: the
# episode only (its call regenerates from the turn's start); ``sibling`` / ``prompt_group``:
# nothing (the rollout is generated again from scratch).
LevelOf = Callable[[EpisodeRef], RestoreLevel]
LISTED = 10  # episodes or calls named in one log line; the rest are counted


def every_level(_: EpisodeRef) -> RestoreLevel:
    return RestoreLevel.PREFIX


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


@contextmanager
def spent_if_resumed(checkpoint_id: str, why: str) -> Iterator[None]:
    """An instance's ``checkpoint_resumed`` refusal as :class:`CheckpointSpent` (transient):
    instances that resumed a checkpoint refuse its id forever, and the snapshot is to be
    taken again under a new one, not to stop the run's snapshots."""
    try:
        yield
    except EnvRefused as exc:
        if exc.reason != "checkpoint_resumed":
            raise
        raise CheckpointSpent(
            f"{checkpoint_id}: the instances resumed it ({why}) and now refuse this "
            f"checkpoint id; take the snapshot again ({exc})"
        ) from exc


def few(items: Sequence[object]) -> str:
    """The first LISTED items, and how many more: a log line stays one line."""
    named = ", ".join(map(str, items[:LISTED]))
    return named + (f" and {len(items) - LISTED} more" if len(items) > LISTED else "")


def ref_name(ref: EpisodeRef) -> str:
    return f"{ref.rollout_id}#{ref.attempt}"


def engine_failure(exc: BaseException, deadline_s: float) -> str:
    return f"no answer within {deadline_s:g} s" if isinstance(exc, TimeoutError) else str(exc)
