"""The controller's rules across environment instances (docs/design.md sections 5-7).

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

How the calls reach the instances (all at once, the background renewals, polling a parked
one) is :mod:`rollsafe.env.fleet_instances`; what the fleet returns and the pure checks it
applies to the replies are :mod:`rollsafe.env.fleet_rules`.

A failed operation raises ONE error whose class is the most severe of the instances' errors
(invariant > invalid input > unavailable > not ready) and whose message lists every failing
instance. Note for retries: a resumed checkpoint id is never accepted again, so after a failed
:meth:`EnvFleet.prepare_all` the next try needs a new checkpoint id.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollsafe.env.client import EnvClient
from rollsafe.env.fleet_instances import (
    Instances,
    LeaseRenewer,
    renewal_interval,
    stop_task,
    until_idle,
)
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
    _twice,
)
from rollsafe.env.protocol import (
    AdoptedEpisodes,
    CommitRequest,
    EpisodeRef,
    EpisodeResult,
    ForgetRequest,
    PrepareReply,
    PrepareRequest,
    RenewRequest,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    RetireRequest,
    RunEpisode,
    RunLease,
)
from rollsafe.errors import (
    EnvNotReady,
    EnvUnavailable,
    EpisodeParked,
    InvalidInput,
    OwnershipMismatch,
    TopologyMismatch,
)

log = logging.getLogger(__name__)
# How a server that predates run leases refuses one (its 422 names the field).
_LEASE_UNKNOWN = "RunEpisode: lease: Extra inputs are not permitted"


class EnvFleet:
    """Every environment instance of a run, driven together. Owns (and closes) the clients."""

    def __init__(self, instances: Mapping[str, EnvClient]) -> None:
        self._instances = Instances(instances)
        self.names: tuple[str, ...] = self._instances.names
        self._without_leases: set[str] = set()  # instances of a release before run leases

    # -- checkpoint -----------------------------------------------------------------------------

    async def prepare_all(self, checkpoint_id: str, deadline_ts: float) -> FleetPrepared:
        """Park every instance, or none: on any failure every instance is resumed, then the
        error names each blocking instance (and its blockers)."""
        request = _build(PrepareRequest, checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)

        async def prepare(name: str, client: EnvClient) -> PrepareReply:
            await self._instances.identify(name)
            return await client.prepare(request)

        replies, failed = await self._instances.each(self.names, prepare)
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
        summary = self._instances.summary("prepare", failed) if failed else None
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
        every = renew_every_s if renew_every_s is not None else renewal_interval(prepared)
        # Each renewal holds the fleet as long as the first prepare did (and never less than
        # three renewals), so a lost controller's checkpoint still ends by itself.
        window = max(deadline_ts - opened, 3 * every)
        renewer = LeaseRenewer(self._instances, checkpoint_id, window, every)
        task = asyncio.create_task(renewer.run(), name=f"renew {checkpoint_id}")
        try:
            yield prepared
        except BaseException as exc:
            await stop_task(task)
            for note in renewer.notes():
                exc.add_note(note)
            await self._resume_noting(checkpoint_id, exc)
            raise
        await stop_task(task)
        await self.resume_all(checkpoint_id)

    async def renew_all(self, checkpoint_id: str, deadline_ts: float) -> dict[str, float]:
        """Extend every lease (to ``deadline_ts`` + the instance's grace): lease end per
        instance."""
        request = _build(RenewRequest, checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
        replies, failed = await self._instances.each(self.names, lambda _, c: c.renew(request))
        if failed:
            raise self._instances.summary("renew", failed)
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
        self._instances.check_known(scope, "commit scope", InvalidInput)
        requests = {
            name: _build(
                CommitRequest,
                checkpoint_id=checkpoint_id,
                scope=tuple(scope.get(name, ())),
                dest=str(Path(dest_root) / name),
            )
            for name in self.names
        }
        replies, failed = await self._instances.each(self.names, lambda n, c: c.commit(requests[n]))
        if failed:
            raise self._instances.summary("commit", failed)
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
        replies, failed = await self._instances.each(self.names, lambda _, c: c.resume(request))
        if failed:
            raise self._instances.summary("resume", failed)
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
        adopted: Mapping[str, Mapping[str, Sequence[EpisodeRef]]] | None = None,
    ) -> FleetRestored:
        """Each instance restores its part of ``scope`` (as committed: attempt n) from
        ``<root>/<name>``, as attempt n + 1; all or nothing (see :class:`FleetRestored`).
        ``adopted``: per instance, lost instance -> the episodes it committed that this one
        restores too (from ``<root>/<lost>``). ``prefixes`` (model call id -> staged prefix)
        goes to every instance restoring."""
        adopted = adopted or {}
        self._instances.check_known(scope, "restore scope", TopologyMismatch)
        self._instances.check_known(adopted, "adopting instances", TopologyMismatch)
        names = tuple(name for name in self.names if scope.get(name) or adopted.get(name))
        requests = {
            name: _build(
                RestoreRequest,
                restore_id=restore_id,
                source_checkpoint_id=source_checkpoint_id,
                root=str(Path(root) / name),
                scope=tuple(scope.get(name, ())),
                adopted=tuple(
                    AdoptedEpisodes(instance=lost, root=str(Path(root) / lost), scope=tuple(refs))
                    for lost, refs in sorted(adopted.get(name, {}).items())
                ),
                prefixes=dict(prefixes),
                deadline_ts=deadline_ts,
            )
            for name in names
        }

        async def restore(name: str, client: EnvClient) -> RestoreReply:
            await self._instances.identify(name)
            return await client.restore(requests[name])

        replies, failed = await self._instances.each(names, restore)
        why = {name: str(exc) for name, exc in failed.items()}
        for name, reply in replies.items():
            problem = _restore_problem(requests[name].episodes, reply.restored)
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
                (*(ref.next_attempt() for ref in request.episodes), *restored.get(name, ()))
            )
            for name, request in requests.items()
        }
        _, retire_failed = await self._instances.each(
            tuple(retire), lambda n, c: c.retire(RetireRequest(rollouts=retire[n]))
        )
        resume = ResumeRequest(checkpoint_id=restore_id)
        _, resume_failed = await self._instances.each(self.names, lambda _, c: c.resume(resume))
        for what, failures in (("retire", retire_failed), ("resume", resume_failed)):
            for name, exc in failures.items():
                why[name] = "; ".join(filter(None, (why.get(name), f"{what} failed: {exc}")))
        restarts = tuple(ref.next_attempt() for r in requests.values() for ref in r.episodes)
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
        self._instances.check_known(refs_by_instance, op, InvalidInput)
        names = tuple(name for name in self.names if refs_by_instance.get(name))
        requests = {name: _build(model, rollouts=tuple(refs_by_instance[name])) for name in names}

        async def send(name: str, client: EnvClient) -> int:
            request = requests[name]
            if isinstance(request, RetireRequest):
                return (await client.retire(request)).count
            return (await client.forget(request)).count

        counts, failed = await self._instances.each(names, send)
        if failed:
            raise self._instances.summary(op, failed)
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
        await self._instances.identify(instance)
        if instance in self._without_leases:
            run = run.model_copy(update={"lease": None})
        give_up = time.monotonic() + max_wait_s
        while True:
            try:
                return await client.run_episode(run, timeout_s=timeout_s)
            except EpisodeParked as exc:
                if time.monotonic() >= give_up:
                    exc.add_note(f"{instance} still parked after {max_wait_s:g}s")
                    raise
                await until_idle(client, give_up, parked_retry_s)
            except InvalidInput as exc:
                if run.lease is None or _LEASE_UNKNOWN not in str(exc):
                    raise
                # A server of an earlier release (no run leases): refused before it started
                # anything, so the same run goes again without the lease.
                log.warning(
                    "environment instance %s predates run leases: its episodes run without one "
                    "(a dead trainer's attempts there are fenced only by their successors); "
                    "upgrade it",
                    instance,
                )
                self._without_leases.add(instance)
                run = run.model_copy(update={"lease": None})

    async def keep_run_lease(self, lease: RunLease, every_s: float) -> None:
        """Renew ``lease`` on every instance every ``every_s`` until cancelled: while this
        runs, the episodes dispatched under it make effects. Each instance on its own
        schedule: a slow or unreachable instance never holds back another's renewal (in one
        round for all, each would be renewed only as often as the slowest answered, and a
        loaded instance could let the others' leases run out). A failed renewal is logged
        once per outage and tried again next time (an instance restarted learns the lease
        from either)."""
        await asyncio.gather(
            *(self._keep_run_lease_on(name, lease, every_s) for name in self.names)
        )

    async def _keep_run_lease_on(self, name: str, lease: RunLease, every_s: float) -> None:
        client, loop, failing = self._instances.client(name), asyncio.get_running_loop(), False
        while True:
            started = loop.time()
            try:
                await client.lease(lease)
                failing = False
            except Exception as exc:  # whatever it was: tried again next time
                if not failing:  # once per outage, not every round, with what raised it
                    log.warning(
                        "run lease %s on %s not renewed: %s: %s",
                        lease.holder, name, type(exc).__name__, exc,
                        exc_info=not isinstance(exc, EnvUnavailable),
                    )  # fmt: skip
                failing = True
            await asyncio.sleep(max(0.0, every_s - (loop.time() - started)))  # every every_s

    # -- lifecycle ------------------------------------------------------------------------------

    async def aclose(self) -> None:
        await self._instances.aclose()

    async def __aenter__(self) -> EnvFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- plumbing -------------------------------------------------------------------------------

    def _client(self, name: str) -> EnvClient:
        return self._instances.client(name)

    async def _resume_noting(self, checkpoint_id: str, error: BaseException) -> None:
        """Best-effort resume of every instance; its failures become notes on ``error``."""
        try:
            request = ResumeRequest(checkpoint_id=checkpoint_id)
        except ValidationError as exc:  # an id no instance can have accepted
            error.add_note(f"resume skipped: {exc.errors()[0]['msg']}")
            return
        _, failed = await self._instances.each(self.names, lambda _, c: c.resume(request))
        for name, why in sorted(failed.items()):
            error.add_note(f"resume on {name} failed: {why}")
