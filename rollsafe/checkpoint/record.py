"""One checkpoint's record in its controller: everything its phases hand each other, from the
first phase called to the last, with one lifetime.

- the phase ledger's part (rollsafe.checkpoint.phase_ledger): each phase's stored result, a
  lock per phase, whether it resumed or aborted;
- the draft's part (rollsafe.checkpoint.drafts): the draft while it is open, the capture taken
  in the park window and what publish wrote of it, or why the draft was discarded;
- the participants' part: what the environments parked (prepare), the replies left on the
  wire (drain), the engines' cut, what the instances committed, and the park lease's renewal.

The phase ledger keeps the records of the run's recent checkpoints (and always the open one);
a record lets go of its heavy parts (the capture's views, the inventory) once its draft is
published or discarded, so the records kept cost their results only.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field

from rollsafe.core.phases import PHASES, Phase, PhaseResult, SnapshotSpec
from rollsafe.core.run_state import Capture, Captured
from rollsafe.engine.staging import StagedCut
from rollsafe.env.fleet_rules import FleetCommitted, FleetPrepared
from rollsafe.env.protocol import EpisodeRef
from rollsafe.errors import InvalidInput, SnapshotLost
from rollsafe.snapshot import SnapshotDraft

ABORT = "abort"  # the key of abort's lock and effect counter, beside the phases
KEYS: tuple[str, ...] = (*PHASES, ABORT)


@dataclass
class CheckpointRecord:
    spec: SnapshotSpec
    # -- the phase ledger's ------------------------------------------------------------------
    results: dict[Phase, PhaseResult] = field(default_factory=dict)
    locks: dict[str, threading.Lock] = field(
        default_factory=lambda: {key: threading.Lock() for key in KEYS}
    )
    # Resumed or aborted: it may never open or close the gate again (checked and set under
    # the ledger's lock, so a late duplicate attempt cannot slip in between).
    resumed: bool = False
    aborted: PhaseResult | None = None
    # When a phase of it last began or ended (the ledger's clock), and how many run now: a
    # draft nobody calls on for its lease is its workflow's leftover (rollsafe.checkpoint.drafts).
    touched_at: float = 0.0
    running: int = 0
    lease_s: float = 0.0  # its admission lease, as its open asked
    # -- the draft's -------------------------------------------------------------------------
    draft: SnapshotDraft | None = None  # open from phase open until published or discarded
    draft_lock: threading.Lock = field(default_factory=threading.Lock)  # who may write into it
    capture: Capture | None = None  # taken in the park window (capture phase)
    captured: Captured | None = None  # written into the draft, after resume (publish phase)
    released: bool = False  # the capture's hold on the run's deletions has ended
    discarded: str | None = None  # why the draft was discarded: never published
    # -- the participants' -------------------------------------------------------------------
    prepared: FleetPrepared | None = None
    renewed_at: float = 0.0  # time.monotonic() of the park lease's last renewal (or prepare)
    renewing: concurrent.futures.Future[None] | None = None
    stragglers: list[EpisodeRef] = field(default_factory=list)
    cut: StagedCut | None = None
    committed: FleetCommitted | None = None

    @property
    def checkpoint_id(self) -> str:
        return self.spec.checkpoint_id

    @property
    def seq(self) -> int:
        return self.spec.seq

    @property
    def files(self) -> SnapshotDraft:
        """The open draft; :class:`SnapshotLost` naming why when there is none."""
        self.check_usable()
        if self.draft is None:
            raise SnapshotLost(f"checkpoint {self.checkpoint_id} has no draft open here")
        return self.draft

    def check_usable(self) -> None:
        if self.discarded is not None:
            raise SnapshotLost(
                f"checkpoint {self.checkpoint_id}: its draft was discarded "
                f"({self.discarded}): take the snapshot again"
            )

    def require_prepared(self, phase: str) -> FleetPrepared:
        if self.prepared is None:
            raise InvalidInput(
                f"{phase} of {self.checkpoint_id}: the environments were not prepared"
            )
        return self.prepared

    def let_go(self) -> None:
        """The draft is published or discarded: what only its phases needed goes (the
        capture's views would hold the run's old columns; the results stay)."""
        self.draft = self.capture = self.captured = None
        self.prepared = self.cut = self.committed = None
        self.stragglers = []
