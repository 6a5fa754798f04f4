"""What the checkpoint workflows and the controller say to each other: the ten phases of a
rollout snapshot (docs/design.md section 5) and one typed model in, one out.

Workflow code imports this module (pydantic only, no numpy/torch/ray), so it must stay free
of heavy imports and side effects.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from rollsafe.core.gate import ADMISSION_LEASE_S
from rollsafe.core.ids import checkpoint_id_for
from rollsafe.core.wire import omit_unused


class Phase(StrEnum):
    OPEN = "open"
    CLOSE_ADMISSION = "close_admission"
    RETIRE_DROPPED = "retire_dropped"
    PREPARE_ENVS = "prepare_envs"
    DRAIN = "drain"
    CUT_GENERATION = "cut_generation"
    COMMIT_ENVS = "commit_envs"
    CAPTURE = "capture"
    RESUME = "resume"
    PUBLISH = "publish"


PHASES: tuple[Phase, ...] = tuple(Phase)


class PhaseFacts(NamedTuple):
    """What the workflows, the activities and the controller know of one phase, declared once
    here (its handler is rollsafe.checkpoint.phases.<phase>; its fault points are
    ``phase.<phase>.before`` and ``.after``)."""

    holds_admission: bool  # runs with the gate closed: the admission lease is renewed meanwhile
    park_window: bool  # between close_admission and resume, both included (local activities)
    participants: bool  # talks to environment instances or engines (skipped without them)
    abortable: bool  # a trainer step may still abort the snapshot here (before capture)


# fmt: off
FACTS: Mapping[Phase, PhaseFacts] = MappingProxyType({
    #                          holds_admission park_window participants abortable
    Phase.OPEN:            PhaseFacts(False, False, False, True),
    Phase.CLOSE_ADMISSION: PhaseFacts(False, True,  False, True),
    Phase.RETIRE_DROPPED:  PhaseFacts(True,  True,  True,  True),
    Phase.PREPARE_ENVS:    PhaseFacts(True,  True,  True,  True),
    Phase.DRAIN:           PhaseFacts(True,  True,  True,  True),
    Phase.CUT_GENERATION:  PhaseFacts(True,  True,  True,  True),
    Phase.COMMIT_ENVS:     PhaseFacts(True,  True,  True,  True),
    Phase.CAPTURE:         PhaseFacts(True,  True,  False, False),
    Phase.RESUME:          PhaseFacts(False, True,  False, False),
    Phase.PUBLISH:         PhaseFacts(False, False, False, False),
})
# fmt: on
PARK_WINDOW = frozenset(phase for phase, facts in FACTS.items() if facts.park_window)
PARTICIPANT_PHASES = frozenset(phase for phase, facts in FACTS.items() if facts.participants)


def abortable(phase: Phase | None) -> bool:
    """Whether a snapshot in ``phase`` (None: not started) can still be aborted: from capture
    on, the snapshot owns the run's state."""
    return phase is None or FACTS[phase].abortable


# Errors (ApplicationError types) by which a phase says the snapshot should not be taken at
# all: it ends "skipped", the error's message its reason, not "failed"
# (rollsafe.checkpoint.controller).
SKIPPING_ERRORS = frozenset({"AnchorPassed"})
# Errors after which this checkpoint cannot go on (its park lease ran out, its draft is
# gone): a retry of the phase only holds the snapshot's workflow task, so it is not retried;
# the snapshot fails as transient and the supervisor's next one starts afresh.
ABANDONING_ERRORS = frozenset({"AdmissionLeaseExpired", "CheckpointSpent", "SnapshotLost"})


def holds_admission(phase: Phase) -> bool:
    """Whether a snapshot in ``phase`` holds the admission gate closed (after
    ``close_admission``, before ``resume``): such a phase renews the gate's lease while it
    runs."""
    return FACTS[phase].holds_admission


class SnapshotSpec(BaseModel):
    """Which snapshot: everything a phase needs to find its checkpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    seq: int = Field(ge=1)
    kind: Literal["rollout", "trainer"] = "rollout"
    anchor_step: int | None = Field(default=None, ge=0)
    # Anchors: the weight versions the trainer holds checkpoints of when the snapshot
    # starts. Publish's retention keeps the newest snapshot at each (docs/snapshot-format.md).
    anchors: tuple[NonNegativeInt, ...] = ()

    @property
    def checkpoint_id(self) -> str:
        return checkpoint_id_for(self.run_id, self.seq, self.kind)


class PhaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: SnapshotSpec
    phase: Phase
    # close_admission: how long the gate stays closed without a renewal (rollsafe.core.gate).
    admission_lease_s: float = Field(default=ADMISSION_LEASE_S, gt=0)


class PublishedSnapshotInfo(BaseModel):
    """A published snapshot, small enough for a workflow payload."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    path: str
    checkpoint_id: str
    manifest_sha256: str
    weight_version: int
    loader_position: int
    counts: dict[str, int] = Field(default_factory=dict)


class PhaseResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    phase: Phase
    checkpoint_id: str
    summary: str  # one line for operators: what the phase did, or why it did nothing
    counts: dict[str, int] = Field(default_factory=dict)
    published: PublishedSnapshotInfo | None = None
    # True when this is the stored result of an earlier call with the same
    # (checkpoint_id, phase): activities run at least once, the effect happens once.
    replayed: bool = False


class PartialGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")

    restored: list[int]  # sealed siblings whose rows came back, digest-checked
    resumed: list[int]  # attempts their environment restored (turn/prefix), as attempt + 1
    regenerate: list[int]  # siblings to generate again


class StopReport(BaseModel):
    """A record the journal could not read (docs/journal.md, "What a restore does with
    damage"): reading stopped there, and nothing from it on in its segment was applied."""

    model_config = ConfigDict(extra="forbid")

    segment: str  # the segment file's name
    offset: int  # of the record's frame in it
    record: int  # the id the record there should have had
    reason: Literal["torn", "corrupt"]
    detail: str
    # An earlier restore went on after it (the run's later records are in a segment of its
    # own); the damaged segment is kept as it was, so the stop is reported by every restore.
    superseded: bool = False


class JournalReplayed(BaseModel):
    """What a restore replayed from the journal after its snapshot (docs/journal.md)."""

    model_config = ConfigDict(extra="forbid")

    covered: int  # the snapshot's journal position: records up to it were already in it
    records: int  # records applied after it
    last_id: int  # the last record applied or covered
    rolled_back_groups: list[int] = Field(default_factory=list)  # commits past the weights
    # Where reading stopped (a torn tail after a crash, or a corrupt record), if it did.
    stop: str | None = None
    # Every stop reading found, earlier restores' included (stop is the last one, if no
    # restore went on after it).
    stops: list[StopReport] = Field(default_factory=list)
    # What the restore was told to go on without (RestoreRequest.accept_journal_loss).
    accepted_loss: list[str] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _as_before_when_whole(self, handler: SerializerFunctionWrapHandler) -> Any:
        return omit_unused(handler(self), self, "stops", "accepted_loss")


class RestorePlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    snapshot: str
    checkpoint_id: str
    skipped: dict[str, str]  # newer snapshots refused, with the reason
    loader_position: int
    weight_version: int
    ready: list[int]
    partial: dict[int, PartialGroup]
    released_claims: list[int]
    # Partial groups in redispatch order: admitted (generating) groups first, since they
    # may be the only work that can advance the trainer, then groups never dispatched.
    redispatch: list[int]
    # Instances that could not restore their episodes, and why: those episodes restart from
    # scratch (the next attempt but one) instead of resuming.
    environments_failed: dict[str, str] = Field(default_factory=dict)
    # Instances the snapshot's episodes were committed on that are no longer in the fleet,
    # and what became of their episodes: restored on survivors, or restarted from scratch.
    environments_lost: dict[str, str] = Field(default_factory=dict)
    journal: JournalReplayed | None = None  # None: restored without a journal


class RestoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    restore_id: str  # idempotency key: a retried restore returns the first plan
    # Weight versions the trainer holds checkpoints of: only a snapshot taken at one of them
    # is restored (its rows and the trainer's weights must describe the same steps). None: any.
    # With the journal, the newest of them is restored to: a snapshot at or below it, then
    # the journal, steps committed past it rolled back.
    weight_versions: tuple[int, ...] | None = None
    # Go on although the journal does not continue the snapshot (a gap, a segment or the
    # folder missing, another journal's segments): the records that continue it are replayed,
    # the rest set aside, and the plan (and the restore's journal record) says what was lost.
    accept_journal_loss: bool = False

    @model_serializer(mode="wrap")
    def _as_before_when_strict(self, handler: SerializerFunctionWrapHandler) -> Any:
        return omit_unused(handler(self), self, "accept_journal_loss")
