"""Payloads of the workflows (pydantic, sandbox-safe)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from rollsafe.core.gate import ADMISSION_LEASE_S
    from rollsafe.core.phases import Phase, PhaseResult, PublishedSnapshotInfo, SnapshotSpec
    from rollsafe.core.wire import Evolving


class PhaseOptions(BaseModel):
    """How phase activities are scheduled. Defaults suit a local run; docs/design.md section 5."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start_to_close_s: float = Field(default=600.0, gt=0)
    heartbeat_timeout_s: float = Field(default=5.0, gt=0)
    retry_initial_s: float = Field(default=0.2, gt=0)
    retry_maximum_s: float = Field(default=5.0, gt=0)
    # Attempts per phase before the snapshot fails (and the supervisor counts a failure).
    retry_attempts: int = Field(default=5, ge=1)
    # How long admission stays closed with no phase renewing its lease (their heartbeats do,
    # every second): past it the gate reopens by itself and the snapshot is abandoned.
    admission_lease_s: float = Field(default=ADMISSION_LEASE_S, gt=0)
    # The snapshot workflow's task timeout: the park window's phases run inside its workflow
    # task (local activities), so a worker that dies there holds the snapshot this long before
    # another worker takes it over (and a phase stuck there shows in `describe` after 80 % of it).
    task_timeout_s: float = Field(default=10.0, gt=0)
    # The park window's phases as local activities (no task-queue round trip each). False: each
    # a regular activity, shown as the pending activity in `describe` from its first moment and
    # handed over by its heartbeat timeout, at a round trip per phase (docs/operations.md).
    local_park_window: bool = True

    @model_validator(mode="after")
    def _lease_outlasts_a_takeover(self) -> PhaseOptions:
        for name in ("heartbeat_timeout_s", "task_timeout_s"):
            if self.admission_lease_s <= getattr(self, name):
                raise ValueError(
                    f"admission_lease_s ({self.admission_lease_s:g}) must exceed {name} "
                    f"({getattr(self, name):g}): otherwise the lease runs out before Temporal "
                    "hands a dead worker's phase to another one"
                )
        return self


class SnapshotInput(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: SnapshotSpec
    options: PhaseOptions = PhaseOptions()
    # False for a run with no environment instances and no generation engines: the five
    # participant phases are then bookkeeping, run as local activities. Read only when
    # replaying a snapshot started before the park window's phases all became local
    # activities (workflows/snapshot.py, LOCAL_PARK_WINDOW).
    participants: bool = True


class SnapshotOutcome(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint_id: str
    seq: int
    status: Literal["published", "skipped", "failed"]
    reason: str = ""  # skipped: why (e.g. trainer_state_changed); failed: the error
    error_type: str = ""  # failed: the error class (ApplicationError type)
    transient: bool = False  # failed: would retrying a later snapshot help
    published: PublishedSnapshotInfo | None = None
    phases: list[PhaseResult] = Field(default_factory=list)


class SnapshotStatus(Evolving):
    model_config = ConfigDict(extra="forbid")
    added = ("steps_committed",)  # contract 2

    checkpoint_id: str
    phase: Phase | None
    phase_started_at: float | None  # workflow time (seconds since the epoch)
    abort_reason: str | None
    completed: list[Phase]
    # Steps the trainer committed while this rollout snapshot had not captured yet: its
    # capture includes them (workflows/snapshot.py, OUTLIVES_STEPS).
    steps_committed: list[int] = Field(default_factory=list)


class SupervisorConfig(Evolving):
    model_config = ConfigDict(extra="forbid", frozen=True)
    added = ("warn_unpublished_after",)  # contract 2

    run_id: str
    # Seconds between periodic snapshots; None takes snapshots only on request.
    interval_s: float | None = Field(default=None, gt=0)
    max_consecutive_failures: int = Field(default=3, ge=1)
    # After this many snapshots in a row ended unpublished (skipped or failed), each further
    # one is a WARNING, and the status (SDK, `inspect`) says the run is not being checkpointed.
    warn_unpublished_after: int = Field(default=3, ge=1)
    participants: bool = True  # passed to every snapshot: see SnapshotInput.participants
    # Continue as new after this many snapshots even if the server has not suggested it yet,
    # so a long run's history never nears its limits (one snapshot adds ~10 events here).
    snapshots_per_run: int = Field(default=500, ge=1)
    options: PhaseOptions = PhaseOptions()


class SupervisorState(Evolving):
    """Carried across continue-as-new."""

    model_config = ConfigDict(extra="forbid")
    added = ("unpublished_in_a_row",)  # contract 2

    next_seq: int | None = None  # None: ask the controller (after the newest on disk)
    consecutive_failures: int = 0
    published: int = 0
    skipped: int = 0
    failed: int = 0
    last_outcome: SnapshotOutcome | None = None
    unpublished_in_a_row: int = 0  # skipped or failed since the last published snapshot
    last_committed_step: int | None = None
    pending_anchors: list[int] = Field(default_factory=list)  # trainer steps to anchor
    # Anchors still held: weight versions the trainer holds checkpoints of (sorted). Every
    # snapshot's retention keeps the newest snapshot at each (docs/snapshot-format.md).
    anchors: list[int] = Field(default_factory=list)


class SupervisorInput(BaseModel):
    """One model in (docs/design.md section 12): the config, and the state continue-as-new
    carries."""

    model_config = ConfigDict(extra="forbid")

    config: SupervisorConfig
    state: SupervisorState = Field(default_factory=SupervisorState)


class SupervisorStatus(Evolving):
    model_config = ConfigDict(extra="forbid")
    added = ("warning",)  # contract 2

    run_id: str
    state: SupervisorState
    running_seq: int | None
    running_workflow_id: str | None
    queued_requests: int
    # Set when the run is not being checkpointed: warn_unpublished_after snapshots or more in
    # a row ended unpublished (unpublished_warning).
    warning: str | None = None


def unpublished_warning(state: SupervisorState, warn_after: int) -> str | None:
    """What the run's operator must hear when snapshots keep ending unpublished: a crash now
    restores from the last published one (or starts over), losing everything since."""
    if state.unpublished_in_a_row < warn_after:
        return None
    last = state.last_outcome
    why = f"; the last {last.status}: {last.reason}" if last is not None else ""
    since = (
        "no snapshot published yet: a crash now starts the run over"
        if state.published == 0
        else "a crash now restores the last published one, losing the work since"
    )
    return f"{state.unpublished_in_a_row} snapshots in a row ended unpublished ({since}){why}"
