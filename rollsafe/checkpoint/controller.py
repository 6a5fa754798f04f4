"""The controller (docs/design.md section 4): one run's state, snapshot store, admission gate
and participants; the ten phases of a rollout snapshot (section 5), each idempotent per
``(checkpoint_id, phase)`` behind one entry point; the restore; and the run's own operations
(hand out, dispatch, seal, claim, commit, evict), each behind the same barrier.

Temporal runs an activity at least once, and a timed-out attempt can still be running beside
its retry. So every phase stores its first result and a repeated call returns it with
``replayed=True`` without touching anything; and each phase is itself safe to re-run after
a crash between its effect and its stored result (the ``phase.<name>.after`` fault point):
re-opening finds the open draft, re-closing finds the gate closed, re-capturing finds the
capture done. ``effects`` counts real side effects per phase so tests can prove "once".

The draft lives only in this process (the Ray actor outlives checkpoint workers). A publish
that finds no draft looks the snapshot up in the store (on disk, or in the bucket, whatever
this host's cache holds): an earlier attempt may have published it.

Two fences keep a snapshot from doing harm when its surroundings died:

- a controller started for a run that already has published snapshots is *awaiting restore*
  (docs/design.md invariant 8): it refuses work and snapshots (``AwaitingRestore``) until it has
  restored, or the caller said the run starts over (``start_over=True``);
- ``close_admission`` takes a lease on the gate (:mod:`rollsafe.core.gate`), renewed by every
  phase that runs while the gate is closed and by their activities' heartbeats. If it runs
  out, admission has reopened by itself and the checkpoint is abandoned: its draft is
  discarded and every later phase but ``resume`` refuses with ``AdmissionLeaseExpired``.

Plain Python, no Ray: :mod:`rollsafe.checkpoint.actor` runs this class as the run's named
Ray actor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic import BaseModel, ConfigDict

from rollsafe.checkpoint.outcomes import (
    log_aborted,
    log_phase,
    log_phase_failure,
    log_restore,
    log_restore_failure,
)
from rollsafe.checkpoint.participants import (
    ENVS_DIR,
    NOTHING_TO_DO,
    RECORD_FILE,
    ParticipantPhases,
    Participants,
)
from rollsafe.core.config import KEEP_LATEST_K, RunConfig
from rollsafe.core.gate import AdmissionGate, Clock, GateChange, GateCounters
from rollsafe.core.ids import EpisodeId
from rollsafe.core.phases import (
    PHASES,
    Phase,
    PhaseRequest,
    PhaseResult,
    PublishedSnapshotInfo,
    RestorePlan,
    RestoreRequest,
    SnapshotSpec,
    holds_admission,
)
from rollsafe.core.run_state import Capture, Captured, RunState
from rollsafe.dataplane import Row, make_dataplane
from rollsafe.engine.staging import drop_staged
from rollsafe.errors import (
    AdmissionLeaseExpired,
    AnchorPassed,
    AwaitingRestore,
    CheckpointRefused,
    InvalidInput,
    SnapshotLost,
    StorageFailed,
)
from rollsafe.faults import fault_point, register
from rollsafe.journal.run import RunJournal, restore_target
from rollsafe.observability import metrics
from rollsafe.snapshot import (
    FAULT_POINTS,
    EntryState,
    PublishedSnapshot,
    SnapshotDraft,
    SnapshotStore,
)
from rollsafe.snapshot.location import open_snapshot_store

if TYPE_CHECKING:
    from rollsafe.settings import Settings

ABORT = "abort"  # the key of abort's lock and effect counter, beside the phases
KEEP_CHECKPOINTS = 16  # stored results kept for this many recent checkpoint ids


class OwedRollout(NamedTuple):
    """A rollout handed out and not sealed (:meth:`Controller.owed`)."""

    group: int
    sibling: int
    attempt: int  # its current attempt; dispatch starts the next one where needed
    owner: str | None  # the environment instance holding its episode; None: any


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


@dataclass
class OpenCheckpoint:
    """The checkpoint whose draft is open here (at most one at a time)."""

    spec: SnapshotSpec
    draft: SnapshotDraft
    lock: threading.Lock = field(default_factory=threading.Lock)  # who may touch the draft
    capture: Capture | None = None  # taken in the park window (capture phase)
    captured: Captured | None = None  # written into the draft, after resume (publish phase)
    released: bool = False  # the capture's hold on the run's deletions has ended
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
    # Controller._meta, so a late duplicate attempt cannot slip in between).
    resumed: bool = False
    aborted: PhaseResult | None = None
    thrown_away: str | None = None  # why its draft was discarded: a retry names it


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


# Inside publish (SnapshotStore's own points), e.g. ROLLSAFE_FAULT=store.before_rename.
STORE_POINTS = register(*(f"store.{point}" for point in FAULT_POINTS))


def _store_fault(point: str) -> None:
    fault_point(f"store.{point}")


log = logging.getLogger(__name__)
_PUBLISHED_STATES = (EntryState.VALID, EntryState.INVALID, EntryState.UNCHECKED)


class Controller:
    """One run's controller (docs/design.md section 4): its state (:class:`RunState`), its
    snapshot store, the admission gate and its participants; the ten phases of a snapshot, a
    restore, and the run's own operations, all behind one barrier.

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
            fault_hook=_store_fault,
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
            participants=settings.participants.connect(),
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
        self.state = state
        self.store = store
        self.gate = AdmissionGate(clock, on_expired=self._admission_expired)
        # The run's environments and engines; None: phases 3-7 have nothing to do.
        self.participants = participants
        self._awaiting_restore = not start_over and any(
            entry.state in _PUBLISHED_STATES for entry in store.list(verify=False)
        )
        # The run's changes between snapshots (docs/journal.md); None: the journal is off.
        self.journal = journal
        if journal is not None and not self._awaiting_restore:
            journal.start(state)  # else the restore attaches it, after replaying it
        # Held by capture and by every call that changes the controller's state
        # (rollsafe.checkpoint.actor.Controller), so a capture sees the run standing still.
        self.barrier = threading.Lock()
        self._phases = (
            ParticipantPhases(participants, self.barrier, lambda: self.state)
            if participants is not None
            else None
        )
        self._meta = threading.RLock()  # held briefly: guards the fields below
        self._open: OpenCheckpoint | None = None
        self._records: OrderedDict[str, CheckpointRecord] = OrderedDict()
        self.effects: dict[str, int] = {str(key): 0 for key in (*PHASES, ABORT)}
        self._restores: dict[str, RestorePlan] = {}
        metrics.configure_metrics()  # where the instruments record: OTEL_METRICS_EXPORTER
        if self._awaiting_restore:
            log.info(
                "run %s has published snapshots: this controller awaits its restore "
                "(work and snapshots are refused until then)",
                store.run_id,
                extra={"run_id": store.run_id},
            )

    # ---- checkpoint phases -----------------------------------------------------------------

    def run_phase(self, request: PhaseRequest) -> PhaseResult:
        spec, phase = request.spec, request.phase
        record = self._record(spec)
        with record.locks[phase]:
            if (stored := record.results.get(phase)) is not None:
                replayed = stored.model_copy(update={"replayed": True})
                log_phase(spec, replayed, 0.0)
                return replayed
            if record.aborted is not None and phase is not Phase.RESUME:
                raise CheckpointRefused(
                    f"checkpoint {spec.checkpoint_id} was aborted: {phase} refused"
                )
            fault_point(f"phase.{phase}.before")
            started = time.monotonic()
            try:
                with metrics.timed_phase(spec.run_id, phase):
                    result = self._run(request, record)
            except Exception as exc:
                log_phase_failure(spec, phase, exc, time.monotonic() - started)
                raise
            log_phase(spec, result, time.monotonic() - started)
            fault_point(f"phase.{phase}.after")
            record.results[phase] = result
            return result

    def abort(self, spec: SnapshotSpec) -> PhaseResult:
        """Discard the draft, if any, and reopen the gate; stored results are kept."""
        record = self._record(spec)
        with record.locks[ABORT]:
            if record.aborted is not None:
                return record.aborted.model_copy(update={"replayed": True})
            with self._meta:
                record.resumed = True
            try:
                resumed = self._resume_participants(spec.checkpoint_id)
            finally:
                with self._meta:
                    change = self.gate.open(spec.checkpoint_id)
                metrics.admission_reopened(spec.run_id, spec.checkpoint_id, change)
            entry = self._entry(spec.checkpoint_id)
            if entry is not None:
                self._discard(entry, "aborted")  # for a phase that found the entry before abort
            discarded = "draft discarded" if entry else "no draft to discard"
            self._effect(ABORT, entry is not None or change.changed)
            record.aborted = phase_result(
                spec, Phase.RESUME, f"aborted: {discarded}; {resumed}admission {change.detail}"
            )
            log_aborted(spec, record.aborted)
            return record.aborted

    def _run(self, request: PhaseRequest, record: CheckpointRecord) -> PhaseResult:
        spec, phase = request.spec, request.phase
        cid = spec.checkpoint_id
        if phase is not Phase.RESUME:
            self._check_lease(spec)
        if phase is Phase.OPEN:
            with _storage_errors(cid, "opening its draft"):
                return self._open_draft(spec, record)
        if phase is Phase.RESUME:
            with self._meta:
                record.resumed = True
            try:
                resumed = self._resume_participants(cid)
            finally:  # admission reopens even when an instance could not be reached (lease)
                with self._meta:
                    change = self.gate.open(cid)
                metrics.admission_reopened(spec.run_id, cid, change)
                self._effect(phase, change.changed)
            return phase_result(spec, phase, f"{resumed}admission {change.detail}")
        if phase is Phase.PUBLISH:
            with _storage_errors(cid, "publishing"):
                return self._publish(spec, self._entry(cid))
        if phase is Phase.CLOSE_ADMISSION:
            with self._meta:  # resume takes it too: it cannot slip between check and close
                if record.resumed:
                    raise CheckpointRefused(
                        f"checkpoint {cid} already resumed: it may not close admission again"
                    )
                self._require_open(spec)
                change = self.gate.close(cid, request.admission_lease_s)
            metrics.admission_closed(spec.run_id, cid, change)
            self._effect(phase, change.changed)
            return phase_result(spec, phase, f"admission {change.detail}")
        entry = self._require_open(spec)
        if holds_admission(phase):
            self.gate.renew(cid)
        if phase is Phase.CAPTURE:
            return self._capture(spec, entry)
        if self.participants is None:
            return phase_result(spec, phase, NOTHING_TO_DO[phase])
        return self._participant_phase(spec, phase, entry, self.participants)

    def _participant_phase(
        self, spec: SnapshotSpec, phase: Phase, entry: OpenCheckpoint, participants: Participants
    ) -> PhaseResult:
        phases = self._phases
        assert phases is not None  # made with the participants
        if phase is not Phase.COMMIT_ENVS:
            summary, counts = phases.run(spec, phase)
            return phase_result(spec, phase, summary, counts)
        with entry.lock:  # COMMIT_ENVS writes into the draft
            self._check_usable(entry)
            committed = participants.commit(spec.checkpoint_id, entry.draft.path, phases.level_of)
            if RECORD_FILE not in entry.draft.files:  # a retried commit records once
                entry.draft.record(ENVS_DIR)
                entry.draft.write_json(RECORD_FILE, committed)
        episodes = sum(len(c.committed) for c in committed.committed.instances.values())
        return phase_result(
            spec, phase, f"{episodes} episodes committed", {"committed_episodes": episodes}
        )

    def _resume_participants(self, checkpoint_id: str) -> str:
        if self.participants is None:
            return ""
        resumed = self.participants.resume(checkpoint_id)
        entry = self._entry(checkpoint_id)
        if entry is None or entry.capture is None:  # else they go once the capture is written
            self._drop_staged()
        return resumed + "; "

    def _open_draft(self, spec: SnapshotSpec, record: CheckpointRecord) -> PhaseResult:
        cid = spec.checkpoint_id
        stale = self._open
        if stale is not None and self.gate.expired(stale.spec.checkpoint_id) is not None:
            self._abandon(stale)  # no phase of it came back to notice: never publishable
        with self._meta:
            self._check_fence(f"checkpoint {cid}")
            if record.resumed:  # a stray late attempt would hold a draft nobody finishes
                raise CheckpointRefused(f"checkpoint {cid} already ended: it may not open again")
            current = self._open
            if current is not None and current.spec.checkpoint_id != cid:
                raise CheckpointRefused(
                    f"checkpoint {cid} cannot open: checkpoint {current.spec.checkpoint_id} "
                    "is still open (publish or abort it first)"
                )
            if current is None:
                current = self._open = OpenCheckpoint(
                    spec, self.store.begin(spec.kind, cid, spec.seq)
                )
                self._effect(Phase.OPEN, True)
        return phase_result(spec, Phase.OPEN, f"draft {current.draft.path.name} open")

    def _capture(self, spec: SnapshotSpec, entry: OpenCheckpoint) -> PhaseResult:
        """Take what the snapshot needs while the run stands still (views, no copy); written
        after resume (:meth:`_write_capture`), so the park window does not grow with the
        ledger."""
        with entry.lock, self.barrier:
            self._check_usable(entry)
            if entry.capture is None:
                self._check_anchor(spec)
                entry.capture = self.state.take_capture()
                self._effect(Phase.CAPTURE, True)
        counts = entry.capture.counts
        summary = f"captured {counts['groups']} groups, {counts['sealed_rollouts']} sealed rollouts"
        return phase_result(spec, Phase.CAPTURE, summary, counts)

    def _write_capture(self, entry: OpenCheckpoint, capture: Capture) -> Captured:
        """Publish's first step: the capture's files and rows into the draft (hash, write,
        fsync), while the run goes on. A failure throws the draft away (a retry would collide
        with the files written): the snapshot is taken again, nothing of the run is lost.
        The caller holds ``entry.lock``."""
        try:
            entry.captured = self.state.write_capture(entry.draft, capture)
        except BaseException as exc:
            self._discard_locked(entry, f"writing the capture failed ({type(exc).__name__}: {exc})")
            raise
        self._end_capture(entry)
        return entry.captured

    def _publish(self, spec: SnapshotSpec, entry: OpenCheckpoint | None) -> PhaseResult:
        published: PublishedSnapshot | None = None
        if entry is not None:
            with entry.lock:
                self._check_usable(entry)
                if entry.capture is None:
                    raise CheckpointRefused(
                        f"checkpoint {spec.checkpoint_id}: publish before capture"
                    )
                done = entry.captured or self._write_capture(entry, entry.capture)
                if entry.draft.path.exists():  # else an earlier attempt renamed it, then failed
                    self.state.journaled(done)
                    published = done.publish(entry.draft, spec.anchor_step, spec.anchors)
                    self._effect(Phase.PUBLISH, not published.reused)
                with self._meta:
                    self._open = None
        if published is None:
            published = self._find_published(spec)
        if entry is not None:  # this process wrote the draft (also if a failed try renamed it)
            metrics.record_capture_bytes(spec.run_id, published.manifest)
            self._compact_journal(spec)
        info = published_info(published)
        how = "reused the earlier publish of" if published.reused else "published"
        return phase_result(spec, Phase.PUBLISH, f"{how} {info.name}", info.counts, info)

    def _compact_journal(self, spec: SnapshotSpec) -> None:
        """After a publish: delete the journal segments every retained snapshot covers. A
        failure costs disk only (the segments stay until the next publish), never the
        snapshot."""
        if self.journal is None:
            return
        try:
            with self.barrier:  # a restore may not swap the journal's segment meanwhile
                deleted = self.journal.compact(self.store)
        except Exception as exc:
            log.warning(
                "checkpoint %s: journal compaction failed (%s: %s); retried at the next publish",
                spec.checkpoint_id,
                type(exc).__name__,
                exc,
            )
            return
        log.debug("checkpoint %s: %d journal segments compacted", spec.checkpoint_id, deleted)

    def _find_published(self, spec: SnapshotSpec) -> PublishedSnapshot:
        """The snapshot an earlier attempt published for this checkpoint, verified where it
        lives (on disk, or downloaded from object storage: the local cache may be gone)."""
        published = self.store.verify_published(spec.seq)
        if published is None:
            with self._meta:
                record = self._records.get(spec.checkpoint_id)
            why = record.thrown_away if record is not None else None
            where = (
                f"its draft was thrown away ({why})"
                if why is not None
                else "no draft here (the controller restarted?)"
            )
            raise SnapshotLost(
                f"checkpoint {spec.checkpoint_id}: {where} and seq {spec.seq} is not "
                "published: take the snapshot again"
            )
        if published.manifest.checkpoint_id != spec.checkpoint_id:
            raise CheckpointRefused(
                f"seq {spec.seq} is published as {published.name} by checkpoint "
                f"{published.manifest.checkpoint_id}, not {spec.checkpoint_id}"
            )
        return published

    def restore(self, request: RestoreRequest) -> RestorePlan:
        """Replace this controller's state with the newest snapshot that verifies (under the
        barrier, so no dispatch sees a half-restored run). Idempotent per ``restore_id``;
        refused while a checkpoint is open. On failure the current state is kept."""
        with self._meta:
            if (plan := self._restores.get(request.restore_id)) is not None:
                log.info(
                    "run %s restore %s replayed: the plan of its first call",
                    request.run_id,
                    request.restore_id,
                    extra={"run_id": request.run_id, "restore_id": request.restore_id},
                )
                return plan
        started = time.monotonic()
        try:
            plan = self._restore(request)
        except Exception as exc:
            log_restore_failure(request, exc, time.monotonic() - started)
            raise
        log_restore(request, plan, time.monotonic() - started)
        return plan

    def _restore(self, request: RestoreRequest) -> RestorePlan:
        with self._meta:
            if self._open is not None:
                raise CheckpointRefused(
                    f"restore {request.restore_id}: checkpoint {self._open.spec.checkpoint_id} "
                    "is open; it must finish or abort first"
                )
        environments, outcomes = (
            self.participants.restorer(request.restore_id)
            if self.participants is not None
            else (None, [])
        )
        accept, replayer = restore_target(
            self.journal, request.weight_versions, accept_loss=request.accept_journal_loss
        )
        with self.barrier:
            current = self.state
            fresh = make_dataplane(current.dataplane.name)
            try:
                restored, plan = RunState.restore(
                    current.config,
                    self.store,
                    fresh,
                    accept=accept,
                    environments=environments,
                    journal=replayer,
                )
                if self.journal is not None:  # its restart durable before anyone is told
                    self.journal.resume()
            except BaseException:
                fresh.clear()  # a remote data plane would keep a half-import forever
                if self.journal is not None:
                    self.journal.abandon_restore()
                if self.participants is not None and outcomes and outcomes[-1].ok:
                    self.participants.abandon_restore(request.restore_id, outcomes[-1])
                raise
            self.state = restored
            current.dataplane.clear()  # replaced by the snapshot's rows
        if self.journal is not None and self.journal.replayed is not None:
            plan = plan.model_copy(update={"journal": self.journal.replayed.summary()})
        drop_staged(restored.dataplane)  # the environments hold what they needed of them
        if self.participants is not None and outcomes and outcomes[-1].ok:
            # (A failed environment restore was undone and resumed by the fleet itself.)
            tokens = self.participants.resume_restored(request.restore_id)
            metrics.record_restored_prefix_tokens(self.store.run_id, tokens)
        metrics.record_restore(self.store.run_id, plan, restored.config.group_size)
        with self._meta:
            self._restores[request.restore_id] = plan
            self._awaiting_restore = False
        return plan

    def next_seq(self) -> int:
        """A seq no snapshot of this run has used: above every published one and every
        checkpoint this controller has seen (an aborted seq's id is never accepted again)."""
        on_disk = [e.seq for e in self.store.list(verify=False) if e.seq is not None]
        with self._meta:
            seen = [record.seq for record in self._records.values()]
        return max([*on_disk, *seen], default=0) + 1

    def status(self) -> ControllerStatus:
        with self._meta:
            return ControllerStatus(
                run_id=self.store.run_id,
                awaiting_restore=self._awaiting_restore,
                open_checkpoint=self._open.spec.checkpoint_id if self._open else None,
                gate_open=self.gate.is_open,
                gate_holder=self.gate.holder,
                gate=self.gate.counters(),
                effects=dict(self.effects),
                done={cid: [p.value for p in r.results] for cid, r in self._records.items()},
            )

    def renew_admission(self, spec: SnapshotSpec) -> bool:
        """Extend the admission lease of ``spec``'s checkpoint (its activities call this
        with every heartbeat). False when it does not hold the gate: nothing changes."""
        return self.gate.renew(spec.checkpoint_id)

    @contextmanager
    def changing(self, what: str, *, durable: bool = True) -> Iterator[None]:
        """The capture barrier, for a call that changes the run's state: refused while the
        controller awaits its restore. With the journal, returns once the change's records
        are durable (the barrier released meanwhile: others append to the same batch);
        ``durable=False``: a change whose loss costs nothing (a dispatch lost in a crash
        leaves its rollout reserved at the same attempt: it is dispatched again)."""
        with self.barrier:
            with self._meta:
                self._check_fence(what)
            sink = self.state.journal if durable else None
            before = sink.last_id if sink is not None else None
            yield
            after = sink.last_id if sink is not None else None
        if sink is not None and after is not None and after != before:
            # Told only once durable: a change acknowledged is never lost (docs/journal.md).
            sink.wait_durable(after)

    # ---- helpers ---------------------------------------------------------------------------

    def _check_fence(self, what: str) -> None:
        if self._awaiting_restore:
            raise AwaitingRestore(
                f"{what} refused: run {self.store.run_id} has published snapshots and this "
                "controller has not restored one; restore it first (Checkpointer.restore), "
                "or start the controller with start_over=True to begin the run again"
            )

    def _check_anchor(self, spec: SnapshotSpec) -> None:
        """A trainer snapshot captures at its anchor's weight version or not at all."""
        version = self.state.weight_version
        if spec.kind == "trainer" and spec.anchor_step is not None and spec.anchor_step != version:
            raise AnchorPassed(
                f"anchor_passed: snapshot {spec.checkpoint_id} is anchored at weight version "
                f"{spec.anchor_step} and the controller is at {version} (a step committed "
                "before it could capture); to be sure of a snapshot at a trainer checkpoint, "
                "await Checkpointer.snapshot_now() before the next step commits"
            )

    def _check_lease(self, spec: SnapshotSpec) -> None:
        """Refuse every phase but resume of a checkpoint whose admission lease expired,
        discarding its draft first (it can never be published)."""
        lease_s = self.gate.expired(spec.checkpoint_id)
        if lease_s is None:
            return
        entry = self._entry(spec.checkpoint_id)
        if entry is not None:
            self._abandon(entry)
        raise AdmissionLeaseExpired(
            f"checkpoint {spec.checkpoint_id}: admission stayed closed past its {lease_s:g} s "
            "lease with no phase renewing it (no worker left?) and reopened by itself; the "
            "snapshot is abandoned, nothing of it is published: take the next one"
        )

    def _abandon(self, entry: OpenCheckpoint) -> None:
        with entry.lock:
            self._discard_locked(entry, entry.broken or "admission lease expired")

    def _discard(self, entry: OpenCheckpoint, why: str) -> None:
        with entry.lock:
            self._discard_locked(entry, why)

    def _discard_locked(self, entry: OpenCheckpoint, why: str) -> None:
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
        self._end_capture(entry)
        with self._meta:
            if (record := self._records.get(entry.spec.checkpoint_id)) is not None:
                record.thrown_away = why
            if self._open is entry:
                self._open = None

    def _end_capture(self, entry: OpenCheckpoint) -> None:
        """The capture's rows are written or never will be: the deletions it held back happen,
        and the staged prefixes leave the live data plane (the snapshot has them, the only
        place a restore reads them from)."""
        if entry.capture is not None and not entry.released:
            entry.released = True
            with self.barrier:
                self.state.release_capture()
            self._drop_staged()

    def _drop_staged(self) -> None:
        if self.participants is not None:
            drop_staged(self.state.dataplane)

    def _admission_expired(self, checkpoint_id: str) -> None:
        """The gate's hook (called under its lock): the park window ended by the lease."""
        metrics.admission_reopened(
            self.store.run_id, checkpoint_id, GateChange(True, "lease expired")
        )
        log.warning(
            "run %s: checkpoint %s held admission closed past its lease; admission reopened "
            "by itself and the snapshot is abandoned",
            self.store.run_id,
            checkpoint_id,
        )

    def _record(self, spec: SnapshotSpec) -> CheckpointRecord:
        if spec.run_id != self.store.run_id:
            raise InvalidInput(f"checkpoint {spec.checkpoint_id} is not of run {self.store.run_id}")
        cid = spec.checkpoint_id
        with self._meta:
            record = self._records.setdefault(cid, CheckpointRecord(spec.seq))
            self._records.move_to_end(cid)
            open_cid = self._open.spec.checkpoint_id if self._open else None
            for old in [c for c in self._records if c not in (cid, open_cid)]:
                if len(self._records) <= KEEP_CHECKPOINTS:
                    break
                del self._records[old]
            return record

    def _entry(self, cid: str) -> OpenCheckpoint | None:
        with self._meta:
            return self._open if self._open and self._open.spec.checkpoint_id == cid else None

    def _require_open(self, spec: SnapshotSpec) -> OpenCheckpoint:
        entry = self._entry(spec.checkpoint_id)
        if entry is None:
            raise SnapshotLost(
                f"checkpoint {spec.checkpoint_id} is not open here (not opened, already "
                "published, or the controller restarted): take the snapshot again"
            )
        return entry

    def _check_usable(self, entry: OpenCheckpoint) -> None:
        if entry.broken is not None:
            raise SnapshotLost(
                f"checkpoint {entry.spec.checkpoint_id}: {entry.broken}: take the snapshot again"
            )

    def _effect(self, key: str, happened: bool) -> None:
        if happened:
            with self._meta:
                self.effects[key] += 1

    # ---- the run's operations: each changes the state behind the barrier --------------------

    # The run's changes are refused (AwaitingRestore) while the controller awaits its restore.

    def handout(self, groups: Sequence[int]) -> None:
        """The data loader hands out these dataset indices (at or above the loader position,
        no repeats): each becomes a group of ``group_size`` rollouts, reserved at the current
        weight version; the loader position moves past the highest."""
        with self.changing("handout"):
            self.state.handout(groups)

    def dispatch(self, idx: int, i: int, owner: str | None = None) -> EpisodeId | None:
        """Dispatch one attempt through the admission gate, in the same step that marks it
        DISPATCHED; None when the gate is closed (the attempt stays RESERVED, spends nothing).
        ``owner``: the environment instance it runs on (default: :meth:`instance_for`)."""
        with self.changing("dispatch", durable=False), self.gate.admission() as admitted:
            if not admitted:
                return None
            return self.state.dispatch(idx, i, owner or self._placed(idx, i))

    def seal(self, idx: int, i: int, attempt: int, row: Row) -> bool:
        """Commit rollout ``i`` of group ``idx`` (its dispatched ``attempt``): ``row`` is its
        training row, named numpy arrays (``rollsafe.dataplane.Row``), stored in the data
        plane under the rollout's key and digested. False when this exact seal was already
        applied (a retry); a different row for a sealed rollout is refused."""
        with self.changing("seal"):
            return self.state.seal(idx, i, attempt, row)

    def claim(self, groups: Sequence[int], step: int) -> None:
        """The trainer takes these ready groups for ``step`` (its optimizer has not committed):
        a restore before :meth:`commit_step` gives them back as ready."""
        with self.changing("claim"):
            self.state.claim(groups, step)

    def commit_step(self, groups: Sequence[int]) -> None:
        """The step that claimed ``groups`` committed: they leave the run for good (their rows
        are dropped) and the weight version goes up by one."""
        with self.changing("commit_step"):
            self.state.commit_step(groups)

    def evict(self, groups: Sequence[int]) -> None:
        """Drop these ready groups on purpose (e.g. :meth:`stale` ones): never trained, never
        owed back. Record the eviction on your side first, so a crash cannot lose it."""
        with self.changing("evict"):
            for idx in groups:
                self.state.evict(idx)

    def set_weight_version(self, version: int) -> None:
        """Move the weight version up to ``version`` (never down): for a run whose policy
        changes other than by one per :meth:`commit_step`, e.g. weights loaded from elsewhere.
        Groups handed out from now on are reserved at it."""
        with self.changing("set_weight_version"):
            self.state.set_weight_version(version)

    def rows(self, groups: Sequence[int]) -> dict[int, list[Row]]:
        """The training rows of ``groups``, each group's in sibling order: groups this step
        claimed (:meth:`claim`) and has not committed; :meth:`commit_step` drops them, so read
        them in between. :class:`InvalidInput` names any group not claimed."""
        with self.barrier:
            return self.state.claimed_rows(groups)

    def instance_for(self, idx: int, i: int) -> str | None:
        """The environment instance rollout ``i`` of group ``idx`` runs on: the one holding its
        episode (a restored episode continues there), else round robin over the participants'
        instances; None for a run without participants."""
        with self.barrier:
            return self._placed(idx, i)

    def _placed(self, idx: int, i: int) -> str | None:
        """:meth:`instance_for`, with the barrier held."""
        owner = self.state.ledger.owner(idx, i)
        if owner is not None or self.participants is None:
            return owner
        return self.participants.instance_for(idx * self.state.config.group_size + i)

    def owed(self) -> list[OwedRollout]:
        """Every rollout handed out and not sealed, each with the environment instance that
        holds its episode (a restored one continues there; None: any): what the run's
        rollout loop must generate, e.g. after a restore. Generating groups come first."""
        with self.barrier:
            ledger = self.state.ledger
            return [
                OwedRollout(idx, i, ledger.attempt(idx, i), ledger.owner(idx, i))
                for idx, i in self.state.owed()
            ]

    def owned(self) -> int:
        """Groups handed out and neither trained nor evicted."""
        with self.barrier:
            return len(self.state.index)

    def weight_version(self) -> int:
        """The current weight version: the number of steps committed (plus any
        :meth:`set_weight_version`). Groups handed out now are reserved at it."""
        with self.barrier:
            return self.state.weight_version

    def select(self) -> list[int]:
        """The ready groups the sampler picks for the next step (``groups_per_step`` of them),
        or [] while not enough are ready."""
        with self.barrier:
            return self.state.select()

    def stale(self) -> list[int]:
        """Ready groups the sampler will never pick (past ``staleness_window``): evicting
        them is the run's call (:meth:`evict`)."""
        with self.barrier:
            return self.state.stale()

    def loader_position(self) -> int:
        """The next dataset index to hand out (every index below it was handed out)."""
        with self.barrier:
            return self.state.loader_position

    def attempt(self, idx: int, i: int) -> int:
        """The current attempt number of rollout ``i`` of group ``idx``."""
        with self.barrier:
            return self.state.ledger.attempt(idx, i)


@contextmanager
def _storage_errors(checkpoint_id: str, doing: str) -> Iterator[None]:
    """The snapshot store's disk refused a write (full, read-only, an I/O error): a transient
    StorageFailed naming it; the run's state is untouched and the next snapshot tries again."""
    try:
        yield
    except OSError as exc:
        raise StorageFailed(
            f"checkpoint {checkpoint_id}: {doing} failed: {exc}; nothing was published and "
            "the run's state is untouched"
        ) from exc
