"""The controller (docs/design.md section 4): a facade over one run's parts, as its Ray actor
exposes it (:mod:`rollsafe.checkpoint.actor`):

- :mod:`~rollsafe.checkpoint.run_service`: the run's state behind the capture barrier, the
  restore fence, the journal's durability, the run's operations (hand out, dispatch, seal, ...);
- :mod:`~rollsafe.checkpoint.phase_ledger`: each ``(checkpoint, phase)``'s stored result, so a
  repeated call is answered without touching anything (``replayed=True``);
- :mod:`~rollsafe.checkpoint.drafts`: the open checkpoint and its draft's life;
- :mod:`~rollsafe.checkpoint.phases`: one handler per phase of a snapshot (section 5), each
  safe to re-run after a crash between its effect and its stored result (the
  ``phase.<name>.after`` fault point): re-opening finds the open draft, and so on;
- :mod:`~rollsafe.checkpoint.restore`: the restore (section 6).

Two fences keep a snapshot from doing harm when its surroundings died:

- a controller started for a run that already has published snapshots is *awaiting restore*
  (docs/design.md invariant 8): it refuses work and snapshots (``AwaitingRestore``) until it has
  restored, or the caller said the run starts over (``start_over=True``);
- ``close_admission`` takes a lease on the gate (:mod:`rollsafe.core.gate`), renewed by every
  phase that runs while the gate is closed and by their activities' heartbeats (which renew the
  environments' park lease too). If it runs out, admission has reopened by itself and the
  checkpoint is abandoned: its draft is discarded and every later phase but ``resume`` refuses
  with ``AdmissionLeaseExpired``.

Locks, in the only order they are taken (a lock is never held while taking one above it):

1. the phase ledger's per-``(checkpoint, phase)`` lock: a duplicate attempt waits for the
   first; held across the phase's own work;
2. the checkpoint record's ``draft_lock`` (rollsafe.checkpoint.record): who may write into
   the draft (capture, commit, publish); held across the draft's own files (and a publish's
   upload: nothing else wants it then);
3. ``RunService.restoring``: a restore, and journal compaction (which deletes segments a
   restore may read); the run's operations never take it;
4. ``RunService.barrier``: the run's state, for every operation and the capture; held across
   I/O only by a restore, while it replaces the state (never by a seal, whose row is put
   outside it, a step's read of its rows, the deletes after commit_step, evict and publish,
   which happen after it is released, a capture, which calls no data plane, or a compaction);
5. ``PhaseLedger.lock``: the ledger's records, the open draft's slot (``DraftSlot.open``), the
   fence's checks paired with the gate's changes (close_admission against resume); held
   across I/O only by ``open``, around making the draft's directory, so a resume cannot slip
   in between (the sweep of old drafts happens before it is taken);
6. the admission gate's own lock (rollsafe.core.gate): never across I/O; its expiry hook runs
   once it is released.

Plain Python, no Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from rollsafe.checkpoint.drafts import DraftSlot, store_fault
from rollsafe.checkpoint.outcomes import log_lease_expired
from rollsafe.checkpoint.participants import Participants
from rollsafe.checkpoint.phase_ledger import ABORT, PhaseLedger
from rollsafe.checkpoint.phases import PhaseContext, abort_once, run_once
from rollsafe.checkpoint.phases.prepare_envs import renew_park
from rollsafe.checkpoint.previous import keep_previous_helpers
from rollsafe.checkpoint.restore import Restores
from rollsafe.checkpoint.run_service import OwedRollout, RunService
from rollsafe.core.config import KEEP_LATEST_K, RunConfig
from rollsafe.core.gate import AdmissionGate, Clock, GateCounters
from rollsafe.core.ids import EpisodeId
from rollsafe.core.phases import (
    Phase,
    PhaseRequest,
    PhaseResult,
    RestorePlan,
    RestoreRequest,
    SnapshotSpec,
)
from rollsafe.core.run_state import RunState
from rollsafe.dataplane import Row, make_dataplane
from rollsafe.errors import InvalidInput
from rollsafe.journal.run import RunJournal
from rollsafe.snapshot import SnapshotStore
from rollsafe.snapshot.location import open_snapshot_store

if TYPE_CHECKING:
    from rollsafe.settings import Settings

__all__ = ["ABORT", "Controller", "ControllerStatus", "OwedRollout"]


class ControllerStatus(BaseModel):
    """What :meth:`Controller.status` reports."""

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


log = logging.getLogger(__name__)


class Controller:
    """One run's controller (docs/design.md section 4): its state (:class:`RunState`), its
    snapshot store, the admission gate and its participants; the ten phases of a snapshot, a
    restore, and the run's own operations.

    Built from plain arguments, so Ray can construct it remotely
    (:func:`rollsafe.checkpoint.actor.start_controller_actor`); :meth:`from_parts` assembles
    one around a state and a store already made (tests, benchmarks)."""

    def __init__(
        self,
        config: RunConfig,
        snapshot_root: Path | str,
        dataplane: str = "memory",
        keep_latest_k: int = KEEP_LATEST_K,
        participants: Participants | None = None,
        *,
        start_over: bool = False,
        snapshot_cache: Path | str | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        """``snapshot_root``: a path (a local disk or a shared POSIX mount) or object storage
        (``s3://``, ``gs://``), whose drafts are staged under ``snapshot_cache``
        (docs/snapshot-format.md). ``start_over``: the run begins again although it has
        published snapshots (they stay until retention removes them); without it such a
        controller awaits its restore. ``clock``: the admission lease's (tests pass a fake
        one)."""
        store = open_snapshot_store(
            snapshot_root,
            config.run_id,
            cache_dir=snapshot_cache,
            keep_latest_k=keep_latest_k,
            fault_hook=store_fault,
        )
        state = RunState(config, make_dataplane(dataplane))
        journal = (
            RunJournal.for_store(store, flush_ms=config.journal_flush_ms)
            if config.journal
            else None
        )
        self._assemble(
            state, store, participants, start_over=start_over, clock=clock, journal=journal
        )

    @classmethod
    def from_settings(
        cls, settings: Settings | None = None, *, start_over: bool = False, **run: Any
    ) -> Controller:
        """The run's controller in this process, from ``settings`` (default:
        :meth:`Settings.load`): run id, ``run:`` section (``run`` keywords on top, e.g.
        ``group_size=8``), snapshot root, data plane, retention and participants."""
        from rollsafe.settings import Settings

        settings = settings if settings is not None else Settings.load()
        return cls(
            settings.run_config(**run),
            settings.require_snapshot_root(),
            dataplane=settings.dataplane,
            keep_latest_k=settings.snapshots.keep_latest_k,
            participants=Participants.from_section(settings.participants),
            start_over=start_over,
            snapshot_cache=settings.snapshots.cache,
        )

    @classmethod
    def from_parts(
        cls,
        state: RunState,
        store: SnapshotStore,
        participants: Participants | None = None,
        *,
        start_over: bool = False,
        clock: Clock = time.monotonic,
        journal: RunJournal | None = None,
    ) -> Controller:
        """A controller around ``state`` and ``store`` (of the same run); ``journal``: the
        run's journal (none by default here)."""
        controller = cls.__new__(cls)
        controller._assemble(
            state, store, participants, start_over=start_over, clock=clock, journal=journal
        )
        return controller

    def _assemble(
        self,
        state: RunState,
        store: SnapshotStore,
        participants: Participants | None,
        *,
        start_over: bool,
        clock: Clock,
        journal: RunJournal | None,
    ) -> None:
        if store.run_id != state.config.run_id:
            raise InvalidInput(
                f"store of run {store.run_id!r}, run state of {state.config.run_id!r}"
            )
        self.store = store
        self.gate = AdmissionGate(clock, on_expired=partial(log_lease_expired, store.run_id))
        awaiting_restore = not start_over and store.has_published()
        # The run's changes between snapshots (docs/journal.md); None: the journal is off.
        if journal is not None and not awaiting_restore:
            journal.start(state)  # else the restore attaches it, after replaying it
        # participants: the run's environments and engines; None: phases 3-7 have nothing to do.
        self.run = RunService(
            store.run_id, state, self.gate, participants, journal, awaiting_restore=awaiting_restore
        )
        self.ledger = PhaseLedger(store.run_id, clock=clock)
        self.drafts = DraftSlot(store, self.run, self.ledger)
        self.restores = Restores(self.run, store, self.drafts)
        if awaiting_restore:
            log.info(
                "run %s has published snapshots: this controller awaits its restore "
                "(work and snapshots are refused until then)",
                store.run_id,
                extra={"run_id": store.run_id},
            )

    # ---- the parts, by the names the controller has always had ----------------------------

    @property
    def state(self) -> RunState:
        return self.run.state

    @property
    def participants(self) -> Participants | None:
        return self.run.participants

    @property
    def journal(self) -> RunJournal | None:
        return self.run.journal

    @property
    def barrier(self) -> threading.Lock:
        return self.run.barrier

    @property
    def effects(self) -> dict[str, int]:
        return self.ledger.effect_counts()

    # ---- checkpoint phases -----------------------------------------------------------------

    def run_phase(self, request: PhaseRequest) -> PhaseResult:
        """Run one phase of a snapshot once: a repeated call gets the stored result."""
        return run_once(_context(self, request))

    def abort(self, spec: SnapshotSpec) -> PhaseResult:
        """Discard the draft, if any, and reopen the gate; stored results are kept."""
        return abort_once(_context(self, PhaseRequest(spec=spec, phase=Phase.RESUME)))

    def changing(self, what: str, *, durable: bool = True) -> AbstractContextManager[None]:
        """The capture barrier, for a call that changes the run's state
        (:meth:`RunService.changing`)."""
        return self.run.changing(what, durable=durable)

    def renew_admission(self, spec: SnapshotSpec) -> bool:
        """Extend the admission lease of ``spec``'s checkpoint (its activities call this
        with every heartbeat), and the environments' park lease with it. False when it does
        not hold the gate: nothing changes."""
        renewed = self.gate.renew(spec.checkpoint_id)
        record = self.ledger.get(spec.checkpoint_id)
        if renewed and self.participants is not None and record is not None:
            renew_park(self.participants, record)
        return renewed

    # ---- restore and status ----------------------------------------------------------------

    def restore(self, request: RestoreRequest) -> RestorePlan:
        """Replace this controller's state with the newest snapshot that verifies (under the
        barrier, so no dispatch sees a half-restored run). Idempotent per ``restore_id``;
        refused while a checkpoint is open. On failure the current state is kept."""
        return self.restores.restore(request)

    def next_seq(self) -> int:
        """A seq no snapshot of this run has used: above every published one and every
        checkpoint this controller has seen (an aborted seq's id is never accepted again)."""
        on_disk = [e.seq for e in self.store.list(verify=False) if e.seq is not None]
        return max([*on_disk, *self.ledger.seqs()], default=0) + 1

    def status(self) -> ControllerStatus:
        return ControllerStatus(
            run_id=self.store.run_id,
            awaiting_restore=self.run.awaiting_restore,
            open_checkpoint=self.drafts.open_id(),
            gate_open=self.gate.is_open,
            gate_holder=self.gate.holder,
            gate=self.gate.counters(),
            effects=self.ledger.effect_counts(),
            done=self.ledger.done(),
        )

    # ---- the run's operations (rollsafe.checkpoint.run_service) ----------------------------

    # The run's changes are refused (AwaitingRestore) while the controller awaits its restore.

    def handout(self, groups: Sequence[int]) -> None:
        """The data loader hands out these dataset indices (at or above the loader position,
        no repeats): each becomes a group of ``group_size`` rollouts, reserved at the current
        weight version; the loader position moves past the highest."""
        self.run.handout(groups)

    def dispatch(self, idx: int, i: int, owner: str | None = None) -> EpisodeId | None:
        """Dispatch one attempt through the admission gate, in the same step that marks it
        DISPATCHED; None when the gate is closed (the attempt stays RESERVED, spends nothing).
        ``owner``: the environment instance it runs on (default: :meth:`instance_for`)."""
        return self.run.dispatch(idx, i, owner)

    def seal(self, idx: int, i: int, attempt: int, row: Row) -> bool:
        """Commit rollout ``i`` of group ``idx`` (its dispatched ``attempt``): ``row`` is its
        training row, named numpy arrays (``rollsafe.dataplane.Row``), stored in the data
        plane under the rollout's key and digested. False when this exact seal was already
        applied (a retry); a different row for a sealed rollout is refused."""
        return self.run.seal(idx, i, attempt, row)

    def claim(self, groups: Sequence[int], step: int) -> None:
        """The trainer takes these ready groups for ``step`` (its optimizer has not committed):
        a restore before :meth:`commit_step` gives them back as ready."""
        self.run.claim(groups, step)

    def commit_step(self, groups: Sequence[int]) -> None:
        """The step that claimed ``groups`` committed: they leave the run for good (their rows
        are dropped) and the weight version goes up by one."""
        self.run.commit_step(groups)

    def evict(self, groups: Sequence[int]) -> None:
        """Drop these ready groups on purpose (e.g. :meth:`stale` ones): never trained, never
        owed back. Record the eviction on your side first, so a crash cannot lose it."""
        self.run.evict(groups)

    def set_weight_version(self, version: int) -> None:
        """Move the weight version up to ``version`` (never down): for a run whose policy
        changes other than by one per :meth:`commit_step`, e.g. weights loaded from elsewhere.
        Groups handed out from now on are reserved at it."""
        self.run.set_weight_version(version)

    def rows(self, groups: Sequence[int]) -> dict[int, list[Row]]:
        """The training rows of ``groups``, each group's in sibling order: groups this step
        claimed (:meth:`claim`) and has not committed; :meth:`commit_step` drops them, so read
        them in between. :class:`InvalidInput` names any group not claimed."""
        return self.run.rows(groups)

    def instance_for(self, idx: int, i: int) -> str | None:
        """The environment instance rollout ``i`` of group ``idx`` runs on: the one holding its
        episode (a restored episode continues there), else round robin over the participants'
        instances; None for a run without participants."""
        return self.run.instance_for(idx, i)

    def owed(self) -> list[OwedRollout]:
        """Every rollout handed out and not sealed, each with the environment instance that
        holds its episode (a restored one continues there; None: any): what the run's
        rollout loop must generate, e.g. after a restore. Generating groups come first."""
        return self.run.owed()

    def owned(self) -> int:
        """Groups handed out and neither trained nor evicted."""
        return self.run.owned()

    def weight_version(self) -> int:
        """The current weight version: the number of steps committed (plus any
        :meth:`set_weight_version`). Groups handed out now are reserved at it."""
        return self.run.weight_version()

    def select(self) -> list[int]:
        """The ready groups the sampler picks for the next step (``groups_per_step`` of them),
        or [] while not enough are ready."""
        return self.run.select()

    def stale(self) -> list[int]:
        """Ready groups the sampler will never pick (past ``staleness_window``): evicting
        them is the run's call (:meth:`evict`)."""
        return self.run.stale()

    def loader_position(self) -> int:
        """The next dataset index to hand out (every index below it was handed out)."""
        return self.run.loader_position()

    def attempt(self, idx: int, i: int) -> int:
        """The current attempt number of rollout ``i`` of group ``idx``."""
        return self.run.attempt(idx, i)


def _context(controller: Controller, request: PhaseRequest) -> PhaseContext:
    """What a phase handler gets (a function, not a method: rollsafe.checkpoint.previous)."""
    record = controller.ledger.record(request.spec, pinned=controller.drafts.open_id())
    drafts, run = controller.drafts, controller.run
    return PhaseContext(request, record, controller.ledger, drafts, run, controller.store)


keep_previous_helpers(Controller)  # see rollsafe.checkpoint.previous
