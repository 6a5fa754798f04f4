"""One environment instance's side of the checkpoint protocol (docs/design.md section 7).

:class:`Participant` owns everything but the environment's own state: the phase machine, the
lease, idempotent replay, retire marks, parking episodes at turn boundaries, and records on disk
(what goes in them: :mod:`rollsafe.env.participant_records`; the files:
:mod:`rollsafe.env.store`). The environment plugs in through
:class:`~rollsafe.env.hooks.EnvironmentHooks`; :mod:`rollsafe.env.router` serves it over HTTP.

Control operations run one at a time under one lock (a second prepare of the same id waits for
the first and replays it). Phase changes are synchronous, so episodes (which run concurrently on
the same loop) never see half of one.

A lease is watched from the moment one is set (prepare, renew, restore), by a task on the
serving loop: however the routes are served, a lapsed lease resumes the instance by itself.
A restore's records are kept per next attempt until a run of that attempt succeeds (or it is
retired): a run that fails (a 503 while the engine is down) is retried from the record, never
from the task.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from rollsafe.env import protocol as wire
from rollsafe.env import store
from rollsafe.env.effects import EffectLedger
from rollsafe.env.hooks import LEGACY_RESTORE, EnvironmentHooks, legacy_restore
from rollsafe.env.participant_records import (
    Restored,
    confined,
    export_records,
    install,
    restored_in_scope,
)
from rollsafe.env.protocol import EpisodeRef, EpisodeResult, InstancePhase
from rollsafe.env.session import Session
from rollsafe.errors import InvalidInput, ParticipantRefused
from rollsafe.faults import fault_point, register

R = TypeVar("R", bound=BaseModel)
log = logging.getLogger(__name__)
_CAPTURED: dict[str, wire.Activity] = {"boundary": "boundary", "generating": "generating"}
# While a restore reads its records (in a thread): tests hold it there to race a run against it.
RESTORE_READING = register("env.restore.reading")[0]


# A checkpoint's lease runs this long past its deadline before the instance resumes by itself.
LEASE_GRACE_S = 30.0
# The furthest a prepare, renew or restore may put its deadline_ts: a deadline years away
# (1e308, say) would park the instance for good. The controller asks for a minute or so
# (ParticipantOptions' park and restore deadlines; its renewals as long as the prepare):
# an hour is far above that and still ends a lost controller's checkpoint.
MAX_LEASE_S = 3600.0
# How long a prepare waits for the tool calls in flight to end.
TOOL_WAIT_S = 5.0
# A run lease this long past its expiry is forgotten (its dispatcher is long gone; an episode
# still holding it is refused all the same: an unknown holder is no lease).
FORGET_LEASE_S = 3600.0
# Ended checkpoints remembered (refused again, their resume replayed). A late call of one
# forgotten would find the instance idle and park it for at most its lease: the controller
# refuses that checkpoint's every later phase (its ledger keeps the highest ended sequence).
CLOSED_KEPT = 1024


class Participant:
    """The checkpoint protocol for one environment instance (see the module docstring)."""

    def __init__(
        self,
        instance: str,
        env: EnvironmentHooks,
        *,
        lease_grace_s: float = LEASE_GRACE_S,
        tool_wait_s: float = TOOL_WAIT_S,
        snapshot_root: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.instance = instance
        self.env = env
        self.legacy = legacy_restore(env)  # the earlier restore_episode: one release more
        if self.legacy:
            warning = LEGACY_RESTORE.format(cls=type(env).__name__)
            log.warning("environment instance %s: %s", instance, warning)
            warnings.warn(warning, DeprecationWarning, stacklevel=2)
        # Where commit and restore may write and read (None: anywhere absolute).
        root = None if snapshot_root is None else os.path.realpath(snapshot_root)
        self.snapshot_root = None if root is None else Path(root)
        self.lease_grace_s = lease_grace_s
        self.tool_wait_s = tool_wait_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._phase: InstancePhase = "idle"
        self._open_id: str | None = None
        self._lease: float | None = None
        # Resumed, aborted or expired: refused from now on (the newest CLOSED_KEPT).
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._replies: dict[tuple[str, str], BaseModel] = {}
        self._parked: dict[str, wire.ParkedEpisode] = {}  # what the open prepare reported, by key
        self._live: dict[str, Session] = {}
        self._retired: set[tuple[str, int]] = set()
        self._restored: dict[str, Restored] = {}  # attempt n + 1's key -> what it continues
        self.effects = EffectLedger()  # applied once per key; superseded attempts fenced
        self._leases: dict[str, float] = {}  # run lease holder -> when it runs out (clock)
        # Set by resume; None while admission is open. Parked episodes wait on it.
        self._release: asyncio.Event | None = None
        self._changed = asyncio.Event()  # an episode changed activity or ended
        self._lease_changed = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None

    # -- lease ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the lease watcher on the running loop. Setting a lease starts it too, so
        calling this is only needed to have it running before the first prepare."""
        loop = asyncio.get_running_loop()
        watcher = self._watcher
        if watcher is None or watcher.done() or watcher.get_loop() is not loop:
            self._watcher = loop.create_task(self._watch())

    async def aclose(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            with suppress(asyncio.CancelledError):
                await watcher

    async def _watch(self) -> None:
        """Until no lease is held: wait for it to run out (or change), then expire it. Ends
        when the lease is gone; the next lease starts it again."""
        while self._lease is not None:
            self._lease_changed.clear()
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation.
                async with asyncio.timeout(max(0.0, self._lease - self._clock())):
                    await self._lease_changed.wait()
                continue
            except TimeoutError:
                pass
            async with self._lock:
                self._expire_if_due()

    def _expire_if_due(self) -> None:
        if self._lease is not None and self._clock() >= self._lease:
            self._close()  # exactly a resume, without a stored reply: a later one gets False

    def _lazy_expire(self) -> None:
        # A control op mid-await owns the state; it checks expiry itself under the lock.
        if not self._lock.locked():
            self._expire_if_due()

    def _set_lease(self, deadline_ts: float) -> float:
        self._lease = deadline_ts + self.lease_grace_s
        self._lease_changed.set()
        self.start()  # a lease nobody watches would never run out without a request
        return self._lease

    # -- phase machine --------------------------------------------------------------------------

    def _stored(self, cid: str, op: str, kind: type[R]) -> R | None:
        reply = self._replies.get((cid, op))
        return reply if isinstance(reply, kind) else None

    def _require(self, cid: str, *phases: InstancePhase) -> None:
        if cid in self._closed:
            raise ParticipantRefused(
                "checkpoint_resumed", f"{cid} was resumed or expired; never again"
            )
        if self._open_id is not None and self._open_id != cid:
            raise ParticipantRefused("other_checkpoint", f"{self._open_id} is open, not {cid}")
        if self._phase not in phases:
            raise ParticipantRefused(
                "wrong_phase", f"{cid}: phase is {self._phase}, not {'/'.join(phases)}"
            )

    def _require_future(self, deadline_ts: float) -> None:
        # A deadline already past would open a lease that has run out: answered "ready", then
        # gone before the commit. The caller's clock or arithmetic is wrong; say so.
        now = self._clock()
        if deadline_ts <= now:
            raise InvalidInput(f"deadline_ts {deadline_ts:.3f} has passed (now {now:.3f})")
        self._require_capped(deadline_ts)

    def _require_capped(self, deadline_ts: float) -> None:
        # Refused, not clamped: a caller asking for a lease this long has its arithmetic wrong
        # (or means harm), and a lease shorter than asked would run out under it unannounced.
        now = self._clock()
        if deadline_ts - now > MAX_LEASE_S:
            raise InvalidInput(
                f"deadline_ts {deadline_ts!r} is more than MAX_LEASE_S={MAX_LEASE_S:g} s "
                f"away (now {now:.3f}): at most {now + MAX_LEASE_S:.3f}"
            )

    def _open(self, phase: InstancePhase, cid: str, deadline_ts: float) -> float:
        self._phase, self._open_id = phase, cid
        return self._set_lease(deadline_ts)

    def _close(self) -> None:
        """End the open phase: what resume and lease expiry both do."""
        cid = self._open_id
        if cid is not None:
            self._mark_closed(cid)
            for op in ("prepare", "commit", "restore"):  # never replayed again: refused
                self._replies.pop((cid, op), None)
        self._phase, self._open_id, self._lease, self._parked = "idle", None, None, {}
        release, self._release = self._release, None
        for session in self._live.values():
            # Before they wake: a prepare right after this must not count them as parked.
            if session.activity == "boundary":
                session.activity = "running"
        if release is not None:
            release.set()
        self._lease_changed.set()

    def _mark_closed(self, cid: str) -> None:
        self._closed[cid] = None
        self._closed.move_to_end(cid)
        while len(self._closed) > CLOSED_KEPT:
            forgotten, _ = self._closed.popitem(last=False)
            self._replies.pop((forgotten, "resume"), None)

    # -- control operations ---------------------------------------------------------------------

    async def prepare(self, request: wire.PrepareRequest) -> wire.PrepareReply:
        cid = request.checkpoint_id
        async with self._lock:
            self._expire_if_due()
            if stored := self._stored(cid, "prepare", wire.PrepareReply):
                return stored
            self._require(cid, "idle")
            self._require_future(request.deadline_ts)
            self._open("prepared", cid, request.deadline_ts)
            self._release = asyncio.Event()  # admission closed; boundaries block from now
            reply = await self._park(request.deadline_ts)
            self._replies[(cid, "prepare")] = reply
            return reply

    async def _park(self, deadline_ts: float) -> wire.PrepareReply:
        tool_until = min(deadline_ts, self._clock() + self.tool_wait_s)
        while True:
            self._changed.clear()
            waiting = [s for s in self._live.values() if s.activity not in _CAPTURED]
            now = self._clock()
            if not waiting or now >= deadline_ts:
                break
            if now >= tool_until and all(s.activity == "tool" for s in waiting):
                break
            until = tool_until if now < tool_until else deadline_ts
            with suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), until - now)
        return self._parked_reply()

    def _parked_reply(self) -> wire.PrepareReply:
        parked, restarts, blockers = [], [], []
        for key, s in sorted(self._live.items()):
            s.moved = False  # from here on, leaving this activity changes the captured state
            if (activity := _CAPTURED.get(s.activity)) is not None:
                park = {"turn": s.turn, "activity": activity, "model_call_id": s.call_id}
                parked.append(wire.ParkedEpisode(episode=s.episode, **park))
            elif s.activity == "tool":
                restarts.append(s.episode)
            else:
                blockers.append(f"{key}: {s.activity} (not at a boundary by the deadline)")
        self._parked = {p.episode.key: p for p in parked}
        assert self._lease is not None
        return wire.PrepareReply(
            ready=not blockers,
            blockers=tuple(blockers),
            parked=tuple(parked),
            restarts=tuple(restarts),
            lease_expires_ts=self._lease,
        )

    async def renew(self, request: wire.RenewRequest) -> wire.RenewReply:
        async with self._lock:
            self._expire_if_due()
            self._require(request.checkpoint_id, "prepared", "committed", "restored")
            self._require_capped(request.deadline_ts)
            return wire.RenewReply(lease_expires_ts=self._set_lease(request.deadline_ts))

    async def commit(self, request: wire.CommitRequest) -> wire.CommitReply:
        cid = request.checkpoint_id
        async with self._lock:
            self._expire_if_due()
            if stored := self._stored(cid, "commit", wire.CommitReply):
                return stored
            self._require(cid, "prepared")
            self._check_scope(request.scope)
            dest = confined(request.dest, "dest", self.snapshot_root)
            records = export_records(self.env, request.scope, self._parked, self.effects)
            env = self.env
            manifest = await asyncio.to_thread(
                store.write_records, dest, env.name, env.kind, self.instance, cid, records,
                portable=env.portable,
            )  # fmt: skip
            self._phase = "committed"
            reply = wire.CommitReply(committed=request.scope, participants=(manifest,))
            self._replies[(cid, "commit")] = reply
            return reply

    def _check_scope(self, scope: tuple[EpisodeRef, ...]) -> None:
        wrong = []
        for ep in scope:
            session = self._live.get(ep.key)
            if ep.key not in self._parked:
                wrong.append(f"{ep.key} (not parked here)")
            elif session is None or session.moved:
                wrong.append(f"{ep.key} (moved on since prepare)")
        if wrong:
            raise ParticipantRefused("not_parked", f"scope names {', '.join(wrong)}")

    async def resume(self, request: wire.ResumeRequest) -> wire.ResumeReply:
        cid = request.checkpoint_id
        async with self._lock:
            self._expire_if_due()
            if stored := self._stored(cid, "resume", wire.ResumeReply):
                return stored
            if self._open_id != cid:
                self._mark_closed(cid)  # never open here, or expired: refused from now on
                return wire.ResumeReply(phase=self._phase, resumed=False)
            self._close()  # a restore's installed records stay: the next attempt continues them
            reply = wire.ResumeReply(phase="idle", resumed=True)
            self._replies[(cid, "resume")] = reply
            return reply

    async def retire(self, request: wire.RetireRequest) -> wire.CountReply:
        async with self._lock:
            self._expire_if_due()
            if self._phase not in ("idle", "restored"):
                raise ParticipantRefused("wrong_phase", f"retire while {self._phase}")
            marks = {(ep.rollout_id, ep.attempt) for ep in request.rollouts}
            count = len(marks - self._retired)
            self._retired |= marks  # marked before anything is dropped: no run slips in
            await self._cancel_runs(request.rollouts)
            for ep in request.rollouts:
                self._restored.pop(ep.key, None)
                self.env.drop_episode(ep)
            return wire.CountReply(count=count)

    async def _cancel_runs(self, episodes: tuple[EpisodeRef, ...]) -> None:
        tasks = []
        for ep in episodes:
            session = self._live.get(ep.key)
            if session is not None and session.task is not None:
                session.retired = True
                session.task.cancel()
                tasks.append(session.task)
        if tasks:  # let them unwind before their state is dropped
            await asyncio.wait(tasks, timeout=self.tool_wait_s)

    async def forget(self, request: wire.ForgetRequest) -> wire.CountReply:
        async with self._lock:
            marks = {(ep.rollout_id, ep.attempt) for ep in request.rollouts}
            count = len(marks & self._retired)
            self._retired -= marks
            return wire.CountReply(count=count)

    async def restore(self, request: wire.RestoreRequest) -> wire.RestoreReply:
        rid = request.restore_id
        async with self._lock:
            self._expire_if_due()
            if stored := self._stored(rid, "restore", wire.RestoreReply):
                return stored
            self._require(rid, "idle")
            self._require_future(request.deadline_ts)
            episodes = request.episodes
            for ep in episodes:
                self._check_free(ep.next_attempt())
            sources = self._sources(request)
            # Restored from here on, before the records are read: a run of a next attempt
            # arriving meanwhile is refused (parked), not admitted fresh.
            lease = self._open("restored", rid, request.deadline_ts)
            try:
                restored: dict[str, Restored] = {}
                for root, scope in sources:
                    read = await asyncio.to_thread(self._read, root, request.source_checkpoint_id)
                    restored |= restored_in_scope(read, scope, root, request.prefixes)
                install(self.env, episodes, restored, legacy=self.legacy)
                for ep in episodes:  # from here on the committed attempts are superseded
                    self.effects.make_current(ep.next_attempt())
                    self.effects.install(ep.rollout_id, restored[ep.key].effects)
            except BaseException:
                self._phase, self._open_id, self._lease = "idle", None, None
                self._lease_changed.set()
                raise
            for ep in episodes:  # each next attempt's runs start from its record
                self._restored[ep.next_attempt().key] = restored[ep.key]
            restored_eps = tuple(ep.next_attempt() for ep in episodes)
            reply = wire.RestoreReply(restored=restored_eps, lease_expires_ts=lease)
            self._replies[(rid, "restore")] = reply
            return reply

    def _sources(self, request: wire.RestoreRequest) -> list[tuple[Path, tuple[EpisodeRef, ...]]]:
        """Where each part of the request's episodes is read from: this instance's own commit,
        then each lost instance's it adopts (refused for an environment whose records are not
        portable: only the instance that wrote them can continue them)."""
        if request.adopted and not self.env.portable:
            lost = ", ".join(adopted.instance for adopted in request.adopted)
            raise InvalidInput(
                f"restore {request.restore_id}: {self.env.name}'s records are not portable "
                f"(EnvironmentHooks.portable is False); episodes of {lost} cannot restore here"
            )
        sources = [(confined(request.root, "root", self.snapshot_root), request.scope)]
        for adopted in request.adopted:
            root = confined(adopted.root, f"adopted root of {adopted.instance}", self.snapshot_root)
            sources.append((root, adopted.scope))
        return [(root, scope) for root, scope in sources if scope]

    def _read(self, root: Path, checkpoint_id: str) -> list[dict[str, Any]]:
        fault_point(RESTORE_READING)
        return store.read_records(root, self.env.name, checkpoint_id)

    # -- episodes -------------------------------------------------------------------------------

    async def run(self, run: wire.RunEpisode) -> EpisodeResult:
        """Drive one episode through the environment; refused (409) while parked or restored,
        when retired, or when it already runs here. A restored attempt's record is spent only
        when a run of it succeeds."""
        self._lazy_expire()
        ep = run.episode
        self._admit(ep)
        restored = self._restored.get(ep.key)
        if run.lease is not None:
            self.take_lease(run.lease)  # a dispatch is its dispatcher's sign of life
        session = Session(self, ep, restored, audit=run.audit, lease=run.lease)
        self._live[ep.key] = session
        try:
            session.task = asyncio.get_running_loop().create_task(
                self.env.run_episode(run, session)
            )
            result = await session.task
            self._restored.pop(ep.key, None)
            audit = None if session.audit is None else session.audit.reply(self.env)
            return result.model_copy(
                update={
                    "restored": restored is not None,
                    "restored_at_turn": session.first_turn if restored is not None else None,
                    "prefix_tokens": session.prefix_tokens,
                    "audit": audit,
                }
            )
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if session.retired and (current is None or not current.cancelling()):
                raise ParticipantRefused("retired", f"{ep.key} was retired while running") from None
            raise
        finally:
            if self._live.get(ep.key) is session:
                del self._live[ep.key]
            self._changed.set()

    def _admit(self, ep: EpisodeRef) -> None:
        if self._phase != "idle":
            raise ParticipantRefused("checkpoint_parked", f"{self._open_id} is {self._phase}")
        self._check_free(ep)
        self.effects.make_current(ep)  # other attempts of the rollout make no more effects

    def clock(self) -> float:
        return self._clock()

    def take_lease(self, lease: wire.RunLease) -> wire.LeaseReply:
        """Take or renew ``lease.holder``'s run lease for ``ttl_s`` from now (this clock)."""
        now = self._clock()
        for holder, expires in list(self._leases.items()):  # long gone: forgotten
            if expires < now - FORGET_LEASE_S:
                del self._leases[holder]
        self._leases[lease.holder] = expires = now + lease.ttl_s
        return wire.LeaseReply(holder=lease.holder, expires_ts=expires)

    def fence(self, session: Session) -> None:
        """Refuse an attempt that may make no further effects: superseded by another attempt
        of its rollout, or dispatched under a run lease that ran out (its dispatcher gone)."""
        self.effects.fence(session.episode)
        lease = session.lease
        if lease is None:
            return
        expires = self._leases.get(lease.holder)
        if expires is None or self._clock() >= expires:
            raise ParticipantRefused(
                "lease_expired",
                f"{session.episode.key}: the run lease of {lease.holder} ran out (not renewed "
                f"within {lease.ttl_s:g} s: its dispatcher is gone); no further effects",
            )

    def applied_effects(self, request: wire.EffectsRequest) -> wire.EffectsReply:
        """What the ledger holds of each rollout: its current attempt, the effects applied."""
        return wire.EffectsReply(
            rollouts=tuple(
                wire.RolloutEffects(
                    rollout_id=rollout,
                    current_attempt=self.effects.current(rollout),
                    live_attempts=tuple(
                        sorted(
                            s.episode.attempt
                            for s in self._live.values()
                            if s.episode.rollout_id == rollout
                        )
                    ),
                    applied=self.effects.of_rollout(rollout),
                )
                for rollout in request.rollouts
            ),
            leases=dict(self._leases),
        )

    def _check_free(self, ep: EpisodeRef) -> None:
        if (ep.rollout_id, ep.attempt) in self._retired:
            raise ParticipantRefused("retired", f"{ep.key} is retired until forgotten")
        if ep.key in self._live:
            raise ParticipantRefused("already_running", f"{ep.key} is already running here")

    def status(self) -> wire.StatusReply:
        self._lazy_expire()
        return wire.StatusReply(
            instance=self.instance,
            phase=self._phase,
            checkpoint_id=self._open_id,
            lease_expires_ts=self._lease,
            live_episodes=len(self._live),
            retired=len(self._retired),
            participants=(self.env.name,),
        )
