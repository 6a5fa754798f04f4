"""What :class:`~rollsafe.coordinator.CheckpointOps` keeps per checkpoint (the open draft,
each checkpoint's stored phase results), what it reports (phase results, its status), and
the errors it refuses with."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from rollsafe.controller import Captured
from rollsafe.errors import InvalidInput, TransientError
from rollsafe.gate import GateCounters
from rollsafe.phases import PHASES, Phase, PhaseResult, PublishedSnapshotInfo, SnapshotSpec
from rollsafe.snapshot import PublishedSnapshot, SnapshotDraft

ABORT = "abort"  # the key of abort's lock and effect counter, beside the phases
KEEP_CHECKPOINTS = 16  # stored results kept for this many recent checkpoint ids


class SnapshotLost(TransientError):
    """This checkpoint's draft is gone or unusable here: the snapshot must start again from
    ``open`` under a new seq. Transient, so the supervisor counts it as such."""


class AwaitingRestore(TransientError):
    """A fresh controller of a run that already has published snapshots is fenced (DESIGN.md
    invariant 8): it takes no work and no snapshot until it has restored, or was started with
    ``start_over=True``. A snapshot of its empty state would become the newest one, and
    retention would delete the run's real state."""


class AdmissionLeaseExpired(TransientError):
    """The checkpoint held admission closed past its lease with no phase renewing it (no
    worker left to run them): the gate reopened by itself, and the snapshot is abandoned
    (its draft discarded, nothing published). The next snapshot starts afresh."""


class AnchorPassed(InvalidInput):
    """A trainer snapshot anchored at weight version N found the controller at another one
    when it came to capture (a step committed first, or the anchor given was not the trainer
    checkpoint's weight version). It is skipped, not failed: a snapshot at another version
    could never be restored with that checkpoint."""


class CheckpointRefused(InvalidInput):
    """A phase the checkpoint may not run: another checkpoint is open, or this one was
    already aborted or resumed. Retrying cannot help."""


class OpsStatus(BaseModel):
    """What :meth:`CheckpointOps.status` reports."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    # Fenced: started for a run with published snapshots, not restored yet (AwaitingRestore).
    awaiting_restore: bool
    open_checkpoint: str | None
    gate_open: bool
    gate_holder: str | None
    gate: GateCounters
    effects: dict[str, int]  # phase (or "abort") -> side effects performed
    done: dict[str, list[str]]  # recent checkpoint id -> phases with a stored result


@dataclass
class OpenCheckpoint:
    """The checkpoint whose draft is open here (at most one at a time)."""

    spec: SnapshotSpec
    draft: SnapshotDraft
    lock: threading.Lock = field(default_factory=threading.Lock)  # who may touch the draft
    captured: Captured | None = None
    broken: str | None = None  # why the draft can no longer be published


@dataclass
class CheckpointRecord:
    """One checkpoint's stored phase results and whether it has ended."""

    seq: int
    results: dict[Phase, PhaseResult] = field(default_factory=dict)
    # One lock per phase, not per checkpoint: a duplicate attempt waits for the first, but
    # resume never waits behind a long phase of its own checkpoint.
    locks: dict[str, threading.Lock] = field(
        default_factory=lambda: {key: threading.Lock() for key in (*PHASES, ABORT)}
    )
    # Resumed or aborted: it may never open or close the gate again (checked and set under
    # CheckpointOps._meta, so a late duplicate attempt cannot slip in between).
    resumed: bool = False
    aborted: PhaseResult | None = None


def phase_result(
    spec: SnapshotSpec,
    phase: Phase,
    summary: str,
    counts: dict[str, int] | None = None,
    published: PublishedSnapshotInfo | None = None,
) -> PhaseResult:
    return PhaseResult(
        phase=phase,
        checkpoint_id=spec.checkpoint_id,
        summary=summary,
        counts=counts or {},
        published=published,
    )


def published_info(published: PublishedSnapshot) -> PublishedSnapshotInfo:
    """A published snapshot, small enough for a workflow payload."""
    manifest = published.manifest
    return PublishedSnapshotInfo(
        name=published.name,
        path=str(published.path),
        checkpoint_id=manifest.checkpoint_id,
        manifest_sha256=published.manifest_sha256,
        weight_version=manifest.weight_version,
        loader_position=manifest.loader_position,
        counts=dict(manifest.counts),
    )
