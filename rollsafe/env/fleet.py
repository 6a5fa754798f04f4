"""The coordinator's rules across environment instances (DESIGN.md sections 5-7).

:class:`EnvFleet` drives every instance of a run at once (``asyncio.gather``) and attributes
each result and each failure to its instance name. Its rules:

* **prepare all or resume all** -- one instance not ready, unreachable or refusing, or one
  rollout reported by two instances, and every instance is resumed before the error is raised;
* **renew while open** -- :meth:`EnvFleet.open` renews the leases in the background and resumes
  every instance on every exit path;
* **commit only the scope** -- an instance that exports anything else, or a participant
  manifest naming another instance or checkpoint, is an :class:`OwnershipMismatch`;
* **restore all or nothing** -- see :class:`FleetRestored`;
* **a parked episode is re-sent, not restarted** -- :meth:`EnvFleet.run_episode`.

Instance names are the mapping's keys; they name each instance's directory under a commit's
``dest_root`` and must be what the instance writes into its participant manifests.

A failed operation raises ONE error whose class is the most severe of the instances' errors
(invariant > invalid input > unavailable > not ready) and whose message lists every failing
instance. Note for retries: a resumed checkpoint id is never accepted again, so after a failed
:meth:`EnvFleet.prepare_all` the next try needs a new checkpoint id.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from rollsafe.env.client import EnvClient, EpisodeParked
from rollsafe.env.fleet_rules import (
    FleetCommitted,
    FleetPrepared,
    FleetRestored,
    InstanceInventory,
    _build,
    _commit_problems,
    _distinct,
    _instance_commit,
    _reported,
    _restore_problem,
    _summary,
    _twice,
)
from rollsafe.env.protocol import (
    CommitRequest,
    EpisodeRef,
    EpisodeResult,
    ForgetRequest,
    PrepareReply,
    PrepareRequest,
    RenewRequest,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    RetireRequest,
    RunEpisode,
)
from rollsafe.errors import (
    EnvNotReady,
    InvalidInput,
    OwnershipMismatch,
    TopologyMismatch,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
_INSTANCE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_RENEW_EVERY_S = 10.0
MIN_RENEW_EVERY_S = 0.1
MAX_POLL_S = 2.0


class EnvFleet:
    """Every environment instance of a run, driven together. Owns (and closes) the clients."""

    def __init__(self, instances: Mapping[str, EnvClient]) -> None:
        if not instances:
            raise InvalidInput("an environment fleet needs at least one instance")
        for name in instances:
            if not _INSTANCE.match(name) or name in (".", ".."):
                raise InvalidInput(f"instance name {name!r} is not [A-Za-z0-9._-]{{1,64}}")
        self._instances = dict(instances)
        self.names: tuple[str, ...] = tuple(sorted(self._instances))

    # -- checkpoint -----------------------------------------------------------------------------

    async def prepare_all(self, checkpoint_id: str, deadline_ts: float) -> FleetPrepared:
        """Park every instance, or none: on any failure every instance is resumed, then the
        error names each blocking instance (and its blockers)."""
        request = _build(PrepareRequest, checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
        replies, failed = await self._each(self.names, lambda _, c: c.prepare(request))
        for name, reply in replies.items():
            if not reply.ready:
                blockers = ", ".join(reply.blockers) or "no reason given"
                failed[name] = EnvNotReady(f"not ready by the deadline: {blockers}")
        error = self._prepare_error(replies, failed)
        if error is not None:
            await self._resume_noting(checkpoint_id, error)
            raise error
        inventory = {
            name: InstanceInventory(
                parked=r.parked, restarts=r.restarts, lease_expires_ts=r.lease_expires_ts
            )
            for name, r in replies.items()
        }
        return FleetPrepared(
            checkpoint_id=checkpoint_id, deadline_ts=deadline_ts, instances=inventory
        )

    def _prepare_error(
        self, replies: Mapping[str, PrepareReply], failed: Mapping[str, Exception]
    ) -> Exception | None:
        # Two owners of one rollout is an invariant broken: it outranks any failure, which
        # then rides along as a note.
        twice = _twice("prepare", _reported(replies))
        summary = self._summary("prepare", failed) if failed else None
        if twice is not None and summary is not None:
            twice.add_note(str(summary))
        return twice or summary

    @asynccontextmanager
    async def open(
        self, checkpoint_id: str, deadline_ts: float, *, renew_every_s: float | None = None
    ) -> AsyncIterator[FleetPrepared]:
        """Prepare all; renew the leases in the background while the body runs; resume all on
        exit. If the body raises, resume and renewal failures become notes on its error; on a
        clean exit a failed resume is raised (the lease would end it, but later)."""
        opened = time.time()
        prepared = await self.prepare_all(checkpoint_id, deadline_ts)
        every = renew_every_s if renew_every_s is not None else _renew_every(prepared)
        # Each renewal holds the fleet as long as the first prepare did (and never less than
        # three renewals), so a lost coordinator's checkpoint still ends by itself.
        window = max(deadline_ts - opened, 3 * every)
        renewer = _Renewer(self, checkpoint_id, window, every)
        task = asyncio.create_task(renewer.run(), name=f"renew {checkpoint_id}")
        try:
            yield prepared
        except BaseException as exc:
            await _stop(task)
            for note in renewer.notes():
                exc.add_note(note)
            await self._resume_noting(checkpoint_id, exc)
            raise
        await _stop(task)
        await self.resume_all(checkpoint_id)

    async def renew_all(self, checkpoint_id: str, deadline_ts: float) -> dict[str, float]:
        """Extend every lease (to ``deadline_ts`` + the instance's grace): lease end per
        instance."""
        request = _build(RenewRequest, checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
        replies, failed = await self._each(self.names, lambda _, c: c.renew(request))
        if failed:
            raise self._summary("renew", failed)
        return {name: reply.lease_expires_ts for name, reply in replies.items()}

    async def commit_all(
        self,
        checkpoint_id: str,
        scope: Mapping[str, Sequence[EpisodeRef]],
        dest_root: str | os.PathLike[str],
    ) -> FleetCommitted:
        """Every instance exports exactly its part of ``scope`` into ``<dest_root>/<name>``
        (an instance without one commits an empty scope, so its participants are present).
        Resumes nothing on failure: that is the caller's exit path (:meth:`open` does it)."""
        self._known(scope, "commit scope", InvalidInput)
        requests = {
            name: _build(
                CommitRequest,
                checkpoint_id=checkpoint_id,
                scope=tuple(scope.get(name, ())),
                dest=str(Path(dest_root) / name),
            )
            for name in self.names
        }
        replies, failed = await self._each(self.names, lambda n, c: c.commit(requests[n]))
        if failed:
            raise self._summary("commit", failed)
        problems = [
            problem
            for name, reply in replies.items()
            for problem in _commit_problems(name, requests[name], reply)
        ]
        exported = {name: reply.committed for name, reply in replies.items()}
        twice = _twice("commit", exported)
        problems.extend([str(twice)] if twice else [])
        if problems:
            raise OwnershipMismatch(f"commit {checkpoint_id}: " + "; ".join(problems))
        return FleetCommitted(
            checkpoint_id=checkpoint_id,
            instances={name: _instance_commit(requests[name], r) for name, r in replies.items()},
        )

    async def resume_all(self, checkpoint_id: str) -> dict[str, ResumeReply]:
        """Resume every instance (also the abort); tries all before raising."""
        request = _build(ResumeRequest, checkpoint_id=checkpoint_id)
        replies, failed = await self._each(self.names, lambda _, c: c.resume(request))
        if failed:
            raise self._summary("resume", failed)
        return replies

    # -- restore --------------------------------------------------------------------------------

    async def restore_all(
        self,
        restore_id: str,
        source_checkpoint_id: str,
        root: str | os.PathLike[str],
        scope: Mapping[str, Sequence[EpisodeRef]],
        prefixes: Mapping[str, Any],
        deadline_ts: float,
    ) -> FleetRestored:
        """Each instance restores its part of ``scope`` (as committed: attempt n) from
        ``<root>/<name>``, as attempt n + 1; all or nothing (see :class:`FleetRestored`).
        ``prefixes`` (model call id -> staged prefix) goes to every instance restoring."""
        self._known(scope, "restore scope", TopologyMismatch)
        names = tuple(name for name in self.names if scope.get(name))
        requests = {
            name: _build(
                RestoreRequest,
                restore_id=restore_id,
                source_checkpoint_id=source_checkpoint_id,
                root=str(Path(root) / name),
                scope=tuple(scope[name]),
                prefixes=dict(prefixes),
                deadline_ts=deadline_ts,
            )
            for name in names
        }
        replies, failed = await self._each(names, lambda n, c: c.restore(requests[n]))
        why = {name: str(exc) for name, exc in failed.items()}
        for name, reply in replies.items():
            problem = _restore_problem(requests[name].scope, reply.restored)
            if problem:
                why[name] = problem
        restored = {name: reply.restored for name, reply in replies.items()}
        if not why:
            return FleetRestored(
                restore_id=restore_id, ok=True, restored=restored, restarts=(), errors={}
            )
        return await self._undo_restore(restore_id, requests, restored, why)

    async def _undo_restore(
        self,
        restore_id: str,
        requests: Mapping[str, RestoreRequest],
        restored: Mapping[str, tuple[EpisodeRef, ...]],
        why: dict[str, str],
    ) -> FleetRestored:
        # Retire on every instance asked to restore, failed ones too: a restore that timed out
        # may still have installed its episodes. Whatever an instance says it restored beyond
        # the expected n + 1 attempts is retired along with them.
        retire = {
            name: _distinct(
                (*(ref.next_attempt() for ref in request.scope), *restored.get(name, ()))
            )
            for name, request in requests.items()
        }
        _, retire_failed = await self._each(
            tuple(retire), lambda n, c: c.retire(RetireRequest(rollouts=retire[n]))
        )
        resume = ResumeRequest(checkpoint_id=restore_id)
        _, resume_failed = await self._each(self.names, lambda _, c: c.resume(resume))
        for what, failures in (("retire", retire_failed), ("resume", resume_failed)):
            for name, exc in failures.items():
                why[name] = "; ".join(filter(None, (why.get(name), f"{what} failed: {exc}")))
        restarts = tuple(ref.next_attempt() for r in requests.values() for ref in r.scope)
        log.warning("restore %s failed, %d rollout(s) restart: %s", restore_id, len(restarts), why)
        return FleetRestored(
            restore_id=restore_id,
            ok=False,
            restored=dict(restored),
            restarts=restarts,
            errors=dict(sorted(why.items())),
        )

    # -- retire / forget ------------------------------------------------------------------------

    async def retire_all(
        self, refs_by_instance: Mapping[str, Sequence[EpisodeRef]]
    ) -> dict[str, int]:
        """Retire episodes (refused until forgotten); count per instance."""
        return await self._marks("retire", RetireRequest, refs_by_instance)

    async def forget_all(
        self, refs_by_instance: Mapping[str, Sequence[EpisodeRef]]
    ) -> dict[str, int]:
        """Drop what each instance holds for these episodes (retire marks included)."""
        return await self._marks("forget", ForgetRequest, refs_by_instance)

    async def _marks(
        self,
        op: str,
        model: type[RetireRequest] | type[ForgetRequest],
        refs_by_instance: Mapping[str, Sequence[EpisodeRef]],
    ) -> dict[str, int]:
        self._known(refs_by_instance, op, InvalidInput)
        names = tuple(name for name in self.names if refs_by_instance.get(name))
        requests = {name: _build(model, rollouts=tuple(refs_by_instance[name])) for name in names}

        async def send(name: str, client: EnvClient) -> int:
            request = requests[name]
            if isinstance(request, RetireRequest):
                return (await client.retire(request)).count
            return (await client.forget(request)).count

        counts, failed = await self._each(names, send)
        if failed:
            raise self._summary(op, failed)
        return counts

    # -- episodes -------------------------------------------------------------------------------

    async def run_episode(
        self,
        instance: str,
        run: RunEpisode,
        *,
        parked_retry_s: float = 0.2,
        max_wait_s: float = 300.0,
        timeout_s: float | None = None,
    ) -> EpisodeResult:
        """Run one episode on ``instance``. While the instance is parked (409
        ``checkpoint_parked``) the episode never started, so the SAME ``run`` is re-sent once
        status says idle: no attempt is spent. Gives up (re-raising :class:`EpisodeParked`)
        when ``max_wait_s`` has passed."""
        client = self._client(instance)
        give_up = time.monotonic() + max_wait_s
        while True:
            try:
                return await client.run_episode(run, timeout_s=timeout_s)
            except EpisodeParked as exc:
                if time.monotonic() >= give_up:
                    exc.add_note(f"{instance} still parked after {max_wait_s:g}s")
                    raise
                await _until_idle(client, give_up, parked_retry_s)

    # -- lifecycle ------------------------------------------------------------------------------

    async def aclose(self) -> None:
        await asyncio.gather(*(client.aclose() for client in self._instances.values()))

    async def __aenter__(self) -> EnvFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- plumbing -------------------------------------------------------------------------------

    def _client(self, name: str) -> EnvClient:
        try:
            return self._instances[name]
        except KeyError:
            raise InvalidInput(f"no environment instance {name!r} (have {self.names})") from None

    def _known(self, by_instance: Mapping[str, object], what: str, cls: type[Exception]) -> None:
        unknown = sorted(set(by_instance) - set(self.names))
        if unknown:
            raise cls(f"{what} names unknown instance(s) {unknown}; the fleet has {self.names}")

    async def _each(
        self, names: Iterable[str], call: Callable[[str, EnvClient], Awaitable[T]]
    ) -> tuple[dict[str, T], dict[str, Exception]]:
        """``call`` on every named instance at once: results and failures by instance."""
        names = tuple(names)
        outcomes = await asyncio.gather(
            *(call(name, self._instances[name]) for name in names), return_exceptions=True
        )
        done: dict[str, T] = {}
        failed: dict[str, Exception] = {}
        for name, outcome in zip(names, outcomes, strict=True):
            if isinstance(outcome, Exception):
                failed[name] = outcome
            elif isinstance(outcome, BaseException):  # cancellation: not a result to keep
                raise outcome
            else:
                done[name] = outcome
        return done, failed

    def _summary(self, op: str, failed: Mapping[str, Exception]) -> Exception:
        return _summary(op, failed, len(self.names))

    async def _resume_noting(self, checkpoint_id: str, error: BaseException) -> None:
        """Best-effort resume of every instance; its failures become notes on ``error``."""
        try:
            request = ResumeRequest(checkpoint_id=checkpoint_id)
        except ValidationError as exc:  # an id no instance can have accepted
            error.add_note(f"resume skipped: {exc.errors()[0]['msg']}")
            return
        _, failed = await self._each(self.names, lambda _, c: c.resume(request))
        for name, why in sorted(failed.items()):
            error.add_note(f"resume on {name} failed: {why}")


class _Renewer:
    """The background renewals of one open checkpoint."""

    def __init__(self, fleet: EnvFleet, checkpoint_id: str, window_s: float, every_s: float):
        self.fleet = fleet
        self.checkpoint_id = checkpoint_id
        self.window_s = window_s
        self.every_s = every_s
        self.rounds = 0
        self.failures: dict[str, str] = {}  # the latest failure per instance

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            await self._round()

    async def _round(self) -> None:
        request = RenewRequest(
            checkpoint_id=self.checkpoint_id, deadline_ts=time.time() + self.window_s
        )
        # A failed renewal is not fatal here: the next round tries again, and a lease that did
        # run out makes the body's next call (commit) fail on its own.
        _, failed = await self.fleet._each(self.fleet.names, lambda _, c: c.renew(request))
        self.rounds += 1
        for name, exc in failed.items():
            log.warning("renew %s on %s failed: %s", self.checkpoint_id, name, exc)
            self.failures[name] = str(exc)

    def notes(self) -> list[str]:
        return [f"renewal on {name} failed: {why}" for name, why in sorted(self.failures.items())]


def _renew_every(prepared: FleetPrepared) -> float:
    lease_s = prepared.lease_expires_ts - time.time()
    return max(min(lease_s / 3, MAX_RENEW_EVERY_S), MIN_RENEW_EVERY_S)


async def _stop(task: asyncio.Task[None]) -> None:
    # asyncio.wait, not `await task`: the task's CancelledError must not be mistaken for (or
    # swallow) a cancellation of the caller.
    task.cancel()
    await asyncio.wait({task})


async def _until_idle(client: EnvClient, give_up: float, first_s: float) -> None:
    """Poll status with backoff until the instance is idle or ``give_up`` passes."""
    delay = first_s
    while True:
        await asyncio.sleep(max(min(delay, give_up - time.monotonic()), 0.0))
        if (await client.status()).phase == "idle" or time.monotonic() >= give_up:
            return
        delay = min(delay * 2, MAX_POLL_S)
