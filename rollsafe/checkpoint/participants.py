"""A run's environments and engines in a snapshot's phases and in a restore (docs/design.md
sections 5 and 6): the work of phases 3-7 and 9 that the phase handlers
(rollsafe.checkpoint.phases) hand over when the run has participants.

The run's dispatcher sends ``/episodes/run`` calls on :attr:`Participants.loop` and records
each in :attr:`Participants.pending` until its reply arrives; this object uses the same loop,
so the drain waits on the dispatcher's own record. What one checkpoint's phases hand each other
(the inventory, the cut, the commit) is kept here per checkpoint id; the controller makes each
phase run once per checkpoint id, and the environment protocol replays each operation too.

The snapshot gets ``envs/<instance>/...`` (what each instance exported, each file hashed into
the manifest) and ``participants.json`` (the committed scope per instance, which calls were cut
and staged): what a restore needs to bring the episodes back as attempt n + 1.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollsafe.core.ids import EpisodeId, RolloutId
from rollsafe.core.ledger import Retirement
from rollsafe.core.run_state import (
    Changed,
    EnvironmentsRestored,
    unchanged,
)
from rollsafe.core.states import RestoreLevel
from rollsafe.dataplane import DataPlane
from rollsafe.engine.http import EngineClient
from rollsafe.engine.protocol import CutRefusal, Engine
from rollsafe.engine.staging import (
    StagedCut,
    cut_and_stage,
    load_prefixes,
)
from rollsafe.env.client import EnvClient
from rollsafe.env.drain import PendingReplies
from rollsafe.env.fleet import EnvFleet
from rollsafe.env.fleet_rules import (
    FleetCommitted,
    FleetPrepared,
    FleetRestored,
    Placement,
    place,
)
from rollsafe.env.participant import MAX_LEASE_S
from rollsafe.env.protocol import MAX_RUN_LEASE_S, EpisodeRef, EpisodeResult, RunEpisode, RunLease
from rollsafe.errors import CheckpointSpent, EnvRefused, InvalidInput, TransientError
from rollsafe.loop_thread import LoopThread
from rollsafe.observability import metrics
from rollsafe.snapshot import SnapshotReader

if TYPE_CHECKING:
    from rollsafe.settings import ParticipantsSection

RECORD_FILE = "participants.json"
ENVS_DIR = "envs"
# What an engine that does not hold a call answers: another engine may know better.
NOT_HERE = frozenset({"not_admitted", "unknown_call"})
LISTED = 10  # episodes or calls named in one log line; the rest are counted
log = logging.getLogger(__name__)


def _few(items: Sequence[object]) -> str:
    """The first LISTED items, and how many more: a log line stays one line."""
    named = ", ".join(map(str, items[:LISTED]))
    return named + (f" and {len(items) - LISTED} more" if len(items) > LISTED else "")


def _ref(ref: EpisodeRef) -> str:
    return f"{ref.rollout_id}#{ref.attempt}"


class ParticipantOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # At most the lease an environment instance grants: a longer deadline would be refused.
    park_deadline_s: float = Field(
        default=30.0, gt=0, le=MAX_LEASE_S, description="prepare: parked by then"
    )
    drain_timeout_s: float = Field(default=10.0, ge=0, description="replies on the wire")
    restore_deadline_s: float = Field(default=60.0, gt=0, le=MAX_LEASE_S)
    # An engine's answer to a cut or a release, within this: past it (or unreachable), its
    # calls are committed at turn level and its release given up, named (docs/operations.md).
    # Above a vLLM cut's wait for its running step; below the environments' park deadline.
    engine_deadline_s: float = Field(default=20.0, gt=0)
    # The run lease episodes are dispatched under, renewed every fifth of it: once this
    # process is gone, the instances refuse its episodes' effects this long after the last
    # renewal at most (docs/environment-protocol.md, "Effects"). 30 s, not less: a lease
    # that runs out while its dispatcher lives stops good episodes (a 5 s one did, twice, on a
    # loaded 2-core CI machine); one that runs long only lets an abandoned attempt go on a
    # while, its effects still answered once from the instance's ledger.
    run_lease_s: float = Field(default=30.0, gt=0, le=MAX_RUN_LEASE_S)


class ParticipantsRecord(BaseModel):
    """``participants.json``: what the snapshot's environments and engines committed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[1] = 1
    committed: FleetCommitted
    staged: dict[str, int] = Field(description="cut call id -> prefix tokens staged")
    refused: dict[str, str] = Field(description="call id -> why it was not cut (turn level)")
    stragglers: tuple[EpisodeRef, ...] = Field(description="replies still out after the drain")


@dataclass
class _Checkpoint:
    prepared: FleetPrepared | None = None
    renewed_at: float = 0.0  # time.monotonic() of the park lease's last renewal (or prepare)
    renewing: concurrent.futures.Future[None] | None = None
    stragglers: list[EpisodeRef] = field(default_factory=list)
    cut: StagedCut | None = None
    committed: FleetCommitted | None = None


# The restore level of a parked episode's group (the ledger's, looked up by the controller):
# what its snapshot must hold. ``prefix``: the episode and its cut call's prefix; ``turn``: the
# episode only (its call regenerates from the turn's start); ``sibling`` / ``prompt_group``:
# nothing (the rollout is generated again from scratch).
LevelOf = Callable[[EpisodeRef], RestoreLevel]


def _every_level(_: EpisodeRef) -> RestoreLevel:
    return RestoreLevel.PREFIX


def to_ref(episode: EpisodeId) -> EpisodeRef:
    return EpisodeRef(rollout_id=episode.rollout.key, attempt=episode.attempt)


def to_episode(ref: EpisodeRef) -> EpisodeId:
    return EpisodeId(RolloutId.parse(ref.rollout_id), ref.attempt)


def _previous(ref: EpisodeRef) -> EpisodeId:
    """Attempt n of a restored (or refused) attempt n + 1."""
    return to_episode(EpisodeRef(rollout_id=ref.rollout_id, attempt=ref.attempt - 1))


class Participants:
    def __init__(
        self,
        fleet: EnvFleet,
        engines: Mapping[str, Engine],
        *,
        loop: LoopThread,
        pending: PendingReplies | None = None,
        options: ParticipantOptions | None = None,
        lease: RunLease | None = None,
    ) -> None:
        self.fleet = fleet
        self.engines = dict(engines)
        self.loop = loop
        self.pending = pending if pending is not None else PendingReplies()
        self.options = options or ParticipantOptions()
        self.lease = lease  # episodes are dispatched under it; None: no run lease
        self._lease_keeper: asyncio.Task[None] | None = None
        self._checkpoints: dict[str, _Checkpoint] = {}
        self._handed_back: dict[str, int] = {}  # restore id -> staged tokens handed back

    @classmethod
    def connect(
        cls,
        envs: Mapping[str, str],
        engines: Mapping[str, str],
        *,
        env_token: str,
        engine_token: str,
        options: ParticipantOptions | None = None,
    ) -> Participants:
        """The run's environment instances (name -> URL of a ``rollsafe env serve``) and
        engines (name -> URL of a ``rollsafe engine serve``) as participants, their clients on
        a loop thread of their own; :meth:`close` ends them. The tokens are the bearer tokens
        the servers were started with."""
        if not envs:
            raise InvalidInput("participants need at least one environment instance")
        loop = LoopThread("rollsafe-participants")

        async def clients() -> tuple[EnvFleet, dict[str, Engine]]:
            fleet = EnvFleet({name: EnvClient(url, env_token) for name, url in envs.items()})
            return fleet, {name: EngineClient(url, engine_token) for name, url in engines.items()}

        fleet, clients_by_name = loop.run(clients())
        options = options or ParticipantOptions()
        holder = f"dispatcher-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        lease = RunLease(holder=holder, ttl_s=options.run_lease_s)
        participants = cls(fleet, clients_by_name, loop=loop, options=options, lease=lease)
        participants.loop.run(participants._keep_lease())
        return participants

    @classmethod
    def from_section(
        cls, section: ParticipantsSection, env: Mapping[str, str] | None = None
    ) -> Participants | None:
        """Clients of the instances and engines the settings' ``participants:`` section names
        (None when it names none); tokens from its files or the variables (``env``: instead
        of os.environ)."""
        if not section.envs and not section.engines:
            return None
        return cls.connect(
            section.envs,
            section.engines,
            env_token=section.env_token(env),
            engine_token=section.engine_token(env),
        )

    async def _keep_lease(self) -> None:
        """Start renewing the run lease in the background (on :attr:`loop`)."""
        if self.lease is not None:
            keeper = self.fleet.keep_run_lease(self.lease, self.lease.ttl_s / 5)
            self._lease_keeper = asyncio.get_running_loop().create_task(keeper)

    def close(self) -> None:
        """Close the clients :meth:`connect` made, and their loop."""

        async def close_clients() -> None:
            if self._lease_keeper is not None:  # closed: its episodes' lease runs out
                self._lease_keeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._lease_keeper
            await self.fleet.aclose()
            for engine in self.engines.values():
                close = getattr(engine, "aclose", None)
                if close is not None:
                    await close()

        self.loop.run(close_clients())
        self.loop.close()

    async def run_episode(
        self,
        episode: EpisodeId,
        instance: str,
        task: Mapping[str, Any],
        seal: Callable[[EpisodeResult], object],
        *,
        max_wait_s: float,
    ) -> EpisodeResult:
        """Run a dispatched episode to its end on ``instance`` and ``seal`` its result (a
        blocking call, run on a thread); on :attr:`loop` only. The call is recorded in
        :attr:`pending` from before it is sent until after the seal, so a snapshot's drain
        waits for its reply and never captures an episode that ended unsealed."""
        ref = to_ref(episode)
        self.pending.add(ref, instance)
        try:
            request = RunEpisode(episode=ref, task=dict(task), lease=self.lease)
            result = await self.fleet.run_episode(instance, request, max_wait_s=max_wait_s)
            await asyncio.to_thread(seal, result)
            return result
        finally:
            self.pending.done(ref)

    def instance_for(self, placement: int) -> str:
        """The instance a new episode goes to: round robin over the sorted instance names by
        ``placement`` (the rollout's position in the run), so placement is reproducible."""
        names = sorted(self.fleet.names)
        return names[placement % len(names)]

    # ---- the snapshot's phases ------------------------------------------------------------

    def retire(self, retirements: Sequence[Retirement]) -> int:
        """Phase 3: environments refuse abandoned attempts from now on (on the instance that
        ran them; everywhere when the owner is not known)."""
        by_instance: dict[str, list[EpisodeRef]] = {}
        for retirement in retirements:
            # An owner no longer in the fleet (lost for good) can run nothing: every instance
            # refuses the attempt instead, as when the owner is not known.
            known = retirement.owner in self.fleet.names
            owners = [retirement.owner] if known and retirement.owner else list(self.fleet.names)
            for name in owners:
                by_instance.setdefault(name, []).append(to_ref(retirement.episode))
        if not by_instance:
            return 0
        counts = self.loop.run(self.fleet.retire_all(by_instance))
        for name, count in sorted(counts.items()):
            log.debug("instance %s retired %d abandoned attempts", name, count)
        return sum(counts.values())

    def prepare(self, checkpoint_id: str) -> FleetPrepared:
        """Phase 4: every instance parks at a turn boundary (or none stays parked)."""
        deadline = time.time() + self.options.park_deadline_s
        # An earlier attempt failed on one instance and resumed the others: they refuse this
        # id forever. Not the run's fault: the next snapshot, under a new id, can.
        with spent_if_resumed(checkpoint_id, "an earlier prepare failed and resumed them"):
            prepared = self.loop.run(self.fleet.prepare_all(checkpoint_id, deadline))
        state = self._state(checkpoint_id)
        state.prepared, state.renewed_at = prepared, time.monotonic()
        _log_prepared(prepared)
        return prepared

    def renew_park(self, checkpoint_id: str) -> concurrent.futures.Future[None] | None:
        """Extend the park lease of ``checkpoint_id``'s instances to the park deadline from
        now, in the background: the admission lease's heartbeats call this, so a park window
        that outlives the park deadline holds while its snapshot's worker lives (once they
        stop, the lease ends the park by itself). At most one renewal in flight, and one per
        quarter of the deadline; None when none started (not parked here, or renewed
        recently). Heartbeats race here harmlessly: at worst two renewals go out."""
        state = self._checkpoints.get(checkpoint_id)
        now = time.monotonic()
        if state is None or state.prepared is None:
            return None
        if state.renewing is not None and not state.renewing.done():
            return None
        if now - state.renewed_at < self.options.park_deadline_s / 4:
            return None
        state.renewed_at = now
        deadline = time.time() + self.options.park_deadline_s
        state.renewing = self.loop.submit(self._renew_park(checkpoint_id, deadline))
        return state.renewing

    async def _renew_park(self, checkpoint_id: str, deadline_ts: float) -> None:
        try:
            await self.fleet.renew_all(checkpoint_id, deadline_ts)
        except Exception as exc:  # the next heartbeat tries again; a lost lease fails commit
            log.warning(
                "checkpoint %s: renewing the environments' park lease failed (%s: %s); the "
                "next heartbeat tries again",
                checkpoint_id,
                type(exc).__name__,
                exc,
                extra={"checkpoint_id": checkpoint_id},
            )

    def drain(self, checkpoint_id: str, *, wait: bool = True) -> list[EpisodeRef]:
        """Phase 5: wait for the replies on the wire outside the commit scope (O(pending)).
        Those still out at the timeout are stragglers: not in the snapshot, so restarted
        after a restore from it alone. ``wait=False`` (the run keeps a journal, where each of
        them seals durably once it lands): none is waited for."""
        prepared = self._prepared(checkpoint_id, "drain")
        scope = {p.episode.key for inv in prepared.instances.values() for p in inv.parked}
        timeout_s = self.options.drain_timeout_s if wait else 0.0

        async def outside() -> list[EpisodeRef]:
            return await self.pending.wait_outside(scope, timeout_s)

        stragglers = self.loop.run(outside())
        self._state(checkpoint_id).stragglers = stragglers
        if stragglers and wait:
            log.warning(
                "checkpoint %s: %d replies still out after the %g s drain, left out of the "
                "snapshot (their rollouts restart after a restore): %s",
                checkpoint_id,
                len(stragglers),
                self.options.drain_timeout_s,
                _few([_ref(ref) for ref in stragglers]),
                extra={"checkpoint_id": checkpoint_id, "stragglers": len(stragglers)},
            )
        return stragglers

    def cut(
        self, checkpoint_id: str, dataplane: DataPlane, level_of: LevelOf = _every_level
    ) -> StagedCut:
        """Phase 6: freeze the parked episodes' calls still generating and stage their
        prefixes; a call no engine could cut is committed at turn level. Only episodes whose
        level is ``prefix`` are cut (at any other level the prefix would never be used)."""
        prepared = self._prepared(checkpoint_id, "cut_generation")
        generating = [
            (p.model_call_id, level_of(p.episode))
            for inv in prepared.instances.values()
            for p in inv.parked
            if p.activity == "generating" and p.model_call_id is not None
        ]
        calls = [call for call, level in generating if level == RestoreLevel.PREFIX]
        cut = self.loop.run(self._cut_everywhere(calls, dataplane)) if calls else _NO_CUT
        skipped = tuple(call for call, level in generating if level != RestoreLevel.PREFIX)
        cut = cut.model_copy(update={"skipped": skipped})
        self._state(checkpoint_id).cut = cut
        _log_cut(checkpoint_id, cut)
        return cut

    def commit(
        self, checkpoint_id: str, snapshot_dir: Path, level_of: LevelOf = _every_level
    ) -> ParticipantsRecord:
        """Phase 7: each instance exports its parked episodes into ``<snapshot>/envs`` (those
        whose level restores episodes: ``turn`` or ``prefix``)."""
        state = self._state(checkpoint_id)
        prepared = self._prepared(checkpoint_id, "commit_envs")
        scope = {
            name: [p.episode for p in inv.parked if level_of(p.episode) >= RestoreLevel.TURN]
            for name, inv in prepared.instances.items()
        }
        # Absolute: the environment servers write there themselves, from their own cwd.
        dest = snapshot_dir.resolve() / ENVS_DIR
        # The instances' park lease ran out before the commit (a phase took longer than it,
        # on a loaded machine): they resumed and refuse this id; the next snapshot can.
        with spent_if_resumed(checkpoint_id, "their park lease ran out before the commit"):
            committed = self.loop.run(self.fleet.commit_all(checkpoint_id, scope, dest))
        state.committed = committed
        _log_committed(committed)
        cut = state.cut or _NO_CUT
        return ParticipantsRecord(
            committed=committed,
            staged=dict(cut.staged),
            refused={r.call_id: r.reason for r in cut.refused},
            stragglers=tuple(state.stragglers),
        )

    def resume(self, checkpoint_id: str) -> str:
        """Phase 9 (and abort): environments resume, frozen calls go on. Every exit path.
        The staged prefixes stay in the live data plane until the capture is written (the
        controller drops them then: kept, every later capture would export them again)."""
        state = self._checkpoints.get(checkpoint_id)
        frozen = _maybe_frozen(state.cut) if state is not None and state.cut is not None else []

        async def resume_all() -> list[str]:
            await self.fleet.resume_all(checkpoint_id)
            if not frozen:
                return []
            failed = await asyncio.gather(
                *(self._release(name, engine, frozen) for name, engine in self.engines.items())
            )
            return [why for why in failed if why]

        not_released = self.loop.run(resume_all())
        log.debug(
            "checkpoint %s: %d instances resumed, %d cut calls released",
            checkpoint_id,
            len(self.fleet.names),
            len(frozen),
        )
        self._checkpoints.pop(checkpoint_id, None)  # kept until done: a retry releases too
        summary = f"{len(self.fleet.names)} instances resumed, {len(frozen)} cut calls released"
        return summary + "".join(f" ({why})" for why in not_released)

    async def _release(self, name: str, engine: Engine, calls: list[str]) -> str | None:
        """Release ``calls`` on one engine; why not, if it did not answer in time. Not raised:
        an engine that cannot be reached either died, and its frozen calls with it (their
        episodes' runs fail and are sent again), or hangs and generates nothing either way;
        failing the phase would only keep the snapshot from publishing until it is back."""
        try:
            await asyncio.wait_for(engine.release(calls), self.options.engine_deadline_s)
            return None
        except (TimeoutError, TransientError) as exc:
            failure = _engine_failure(exc, self.options.engine_deadline_s)
            why = f"engine {name} did not release its cut calls: {failure}"
            log.warning("%s", why, extra={"engine": name})
            return why

    # ---- restore ---------------------------------------------------------------------------

    def restore(
        self,
        restore_id: str,
        snapshot_dir: Path,
        record: ParticipantsRecord,
        dataplane: DataPlane,
        changed: Changed = unchanged,
    ) -> tuple[FleetRestored, Placement]:
        """Bring the committed episodes back as attempt n + 1, with the staged prefixes of
        their cut calls (read from the restored data plane), but those the journal
        ``changed`` since (sealed, restarted, or their group gone): each on its instance, or,
        for an instance no longer in the fleet, on a survivor (:func:`place`). All or
        nothing: on failure no instance keeps any (see :class:`FleetRestored`)."""
        committed = record.committed.instances
        scope = {
            name: [ref for ref in c.committed if not changed(to_episode(ref))]
            for name, c in committed.items()
        }
        portable = {name: all(m.portable for m in c.participants) for name, c in committed.items()}
        placement = place(scope, portable, self.fleet.names)
        for name, what in sorted(placement.lost.items()):
            log.warning("restore %s: instance %s is %s", restore_id, name, what)
        prefixes = load_prefixes(dataplane, record.staged) if record.staged else {}

        as_json = {call: p.model_dump(mode="json") for call, p in prefixes.items()}
        deadline = time.time() + self.options.restore_deadline_s
        restored = self.loop.run(
            self.fleet.restore_all(
                restore_id,
                record.committed.checkpoint_id,
                snapshot_dir.resolve() / ENVS_DIR,
                placement.own,
                as_json,
                deadline,
                adopted=placement.adopted,
            )
        )
        if restored.ok:
            self._handed_back[restore_id] = sum(len(p.tokens) for p in prefixes.values())
            for name, refs in sorted(restored.restored.items()):
                log.debug(
                    "restore %s: instance %s restored %d episodes", restore_id, name, len(refs)
                )
        return restored, placement

    def resume_restored(self, restore_id: str) -> int:
        """The restore succeeded: the environments resume. Returns the tokens of the staged
        prefixes they were handed."""
        self.loop.run(self.fleet.resume_all(restore_id))
        return self._handed_back.pop(restore_id, 0)

    def abandon_restore(self, restore_id: str, restored: FleetRestored) -> None:
        """The controller's restore failed after the environments restored: they must not keep
        the n + 1 attempts (retired: refused until forgotten), and resume."""
        self._handed_back.pop(restore_id, None)
        refs = {name: list(refs) for name, refs in restored.restored.items() if refs}

        async def undo() -> None:
            try:
                if refs:
                    await self.fleet.retire_all(refs)
            finally:
                await self.fleet.resume_all(restore_id)

        self.loop.run(undo())

    def restore_snapshot(
        self, restore_id: str, reader: SnapshotReader, dataplane: DataPlane, changed: Changed
    ) -> tuple[EnvironmentsRestored, FleetRestored | None]:
        """A restore's step between the journal's replay and the restart: the snapshot's
        committed episodes restored on the instances (their staged prefixes read from
        ``dataplane``, where the snapshot was just loaded; episodes the journal ``changed``
        left out). Returns what became of them, and the fleet's outcome (None: a snapshot
        taken without participants restores none) for :meth:`resume_restored` or
        :meth:`abandon_restore`. If the environments fail, the fleet has already retired every
        n + 1 attempt and resumed: those rollouts fall back to a restart from scratch (as
        n + 2) rather than failing the restore (docs/design.md section 6)."""
        if RECORD_FILE not in reader.manifest.files:
            return EnvironmentsRestored({}), None
        record = reader.read_json(RECORD_FILE, ParticipantsRecord)
        outcome, placement = self.restore(restore_id, reader.path, record, dataplane, changed)
        # A stranded episode (placement.stranded) is in neither: it restarts from scratch.
        if not outcome.ok:
            refused = frozenset(_previous(ref) for ref in outcome.restarts)
            failed = EnvironmentsRestored(
                {}, refused=refused, errors=outcome.errors, lost=placement.lost
            )
            return failed, outcome
        restored = EnvironmentsRestored(
            {_previous(ref): name for name, refs in outcome.restored.items() for ref in refs},
            moved=frozenset(to_episode(ref) for ref in placement.moved),
            lost=placement.lost,
        )
        return restored, outcome

    # ---- helpers ---------------------------------------------------------------------------

    async def _cut_everywhere(self, calls: list[str], dataplane: DataPlane) -> StagedCut:
        """Cut on every engine at once (one pass: every engine answers for every call at
        once, so no call is tried again) and merge (:func:`merge_cuts`)."""
        results = await asyncio.gather(
            *(self._cut_on(name, engine, calls, dataplane) for name, engine in self.engines.items())
        )
        return merge_cuts(calls, results)

    async def _cut_on(
        self, name: str, engine: Engine, calls: list[str], dataplane: DataPlane
    ) -> StagedCut:
        """One engine's cut, or, when it does not answer (dead, unreachable, past the
        deadline), every call refused as ``engine_unavailable``: committed at turn level,
        those calls are made again from their turn after a restore, never resumed from a
        prefix nobody staged. The snapshot goes on with the other engines' cuts."""
        try:
            return await asyncio.wait_for(
                cut_and_stage(engine, calls, dataplane), self.options.engine_deadline_s
            )
        except (TimeoutError, TransientError) as exc:
            detail = f"engine {name}: {_engine_failure(exc, self.options.engine_deadline_s)}"
            log.warning(
                "cut on engine %s failed; its calls are committed at turn level: %s", name, detail
            )
            refused = tuple(
                CutRefusal(call_id=call, reason="engine_unavailable", detail=detail)
                for call in calls
            )
            return StagedCut(staged={}, refused=refused, handoffs=0)

    def _state(self, checkpoint_id: str) -> _Checkpoint:
        return self._checkpoints.setdefault(checkpoint_id, _Checkpoint())

    def _prepared(self, checkpoint_id: str, phase: str) -> FleetPrepared:
        prepared = self._state(checkpoint_id).prepared
        if prepared is None:
            raise InvalidInput(f"{phase} of {checkpoint_id}: the environments were not prepared")
        return prepared


_NO_CUT = StagedCut(staged={}, refused=(), handoffs=0)


def merge_cuts(calls: Sequence[str], results: Sequence[StagedCut]) -> StagedCut:
    """Every engine's cut of ``calls`` as one: a call staged by one engine is staged; else the
    reason of the engine that held it (the others say ``not_admitted``), else
    ``engine_unavailable`` if an engine did not answer (it may have held it), or
    ``not_admitted`` from all of them."""
    staged = {call: tokens for result in results for call, tokens in result.staged.items()}
    reasons: dict[str, CutRefusal] = {}
    for refusal in (refusal for result in results for refusal in result.refused):
        known = reasons.get(refusal.call_id)
        if refusal.call_id not in staged and (
            known is None or _weight(refusal.reason) > _weight(known.reason)
        ):
            reasons[refusal.call_id] = refusal
    refused = tuple(
        reasons.get(call) or CutRefusal(call_id=call, reason="unknown_call")  # no engine
        for call in calls
        if call not in staged
    )
    handoffs = sum(result.handoffs for result in results)
    return StagedCut(staged=staged, refused=refused, handoffs=handoffs)


def _maybe_frozen(cut: StagedCut) -> list[str]:
    """The calls a cut may have frozen: those staged, and those of an engine that did not
    answer (a slow one may have frozen them after all): every engine releases them all."""
    unanswered = [r.call_id for r in cut.refused if r.reason == "engine_unavailable"]
    return [*cut.staged, *unanswered]


def _weight(reason: str) -> int:
    """Which engine's refusal of a call says most: one that held it, then one that did not
    answer (it may have held it), then one that never saw it."""
    return 0 if reason in NOT_HERE else 1 if reason == "engine_unavailable" else 2


def _engine_failure(exc: BaseException, deadline_s: float) -> str:
    return f"no answer within {deadline_s:g} s" if isinstance(exc, TimeoutError) else str(exc)


def _log_prepared(prepared: FleetPrepared) -> None:
    """Per instance: what it parked (DEBUG), and episodes it could not park, which restart."""
    cid = prepared.checkpoint_id
    for name, inventory in sorted(prepared.instances.items()):
        log.debug("checkpoint %s: instance %s parked %d episodes", cid, name, len(inventory.parked))
        if inventory.restarts:
            log.info(
                "checkpoint %s: instance %s could not park %d episodes (they restart): %s",
                cid,
                name,
                len(inventory.restarts),
                _few([_ref(ref) for ref in inventory.restarts]),
                extra={"checkpoint_id": cid, "instance": name, "restarts": len(inventory.restarts)},
            )


def _log_cut(checkpoint_id: str, cut: StagedCut) -> None:
    """Calls an engine could not cut lose their generated tokens (they restart at the turn):
    a WARNING; calls not cut because there was nothing to lose: DEBUG."""
    lost = [r for r in cut.refused if r.reason not in metrics.SKIPPED_REFUSALS]
    harmless = len(cut.refused) - len(lost)
    log.debug(
        "checkpoint %s: %d calls cut, %d skipped (coarser level), %d not started or done",
        checkpoint_id,
        len(cut.staged),
        len(cut.skipped),
        harmless,
    )
    if lost:
        log.warning(
            "checkpoint %s: %d generation calls could not be cut and restart from their turn: %s",
            checkpoint_id,
            len(lost),
            _few([f"{r.call_id} ({r.reason}{': ' + r.detail if r.detail else ''})" for r in lost]),
            extra={"checkpoint_id": checkpoint_id, "refused_calls": len(lost)},
        )


def _log_committed(committed: FleetCommitted) -> None:
    """An instance that exported less than its scope: those episodes restart."""
    cid = committed.checkpoint_id
    for name, commit in sorted(committed.instances.items()):
        if commit.missing:
            log.warning(
                "checkpoint %s: instance %s did not export %d episodes of its scope (they "
                "restart): %s",
                cid,
                name,
                len(commit.missing),
                _few([_ref(ref) for ref in commit.missing]),
                extra={"checkpoint_id": cid, "instance": name, "missing": len(commit.missing)},
            )


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
