"""A run's environment instances and generation engines as participants (docs/design.md
sections 5 and 6): their clients, on a loop thread of their own, the run lease episodes are
dispatched under, and the dispatch itself.

The run's dispatcher sends ``/episodes/run`` calls on :attr:`Participants.loop` and records
each in :attr:`Participants.pending` until its reply arrives; a snapshot's phases use the same
loop, so the drain waits on the dispatcher's own record. What a snapshot's phases do with the
participants is in each phase's module (rollsafe.checkpoint.phases), what they hand each
other on the checkpoint's record (rollsafe.checkpoint.record); a restore's part is
rollsafe.checkpoint.restore_envs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from rollsafe.core.ids import EpisodeId, RolloutId
from rollsafe.engine.http import EngineClient
from rollsafe.engine.protocol import Engine
from rollsafe.env.client import EnvClient
from rollsafe.env.drain import PendingReplies
from rollsafe.env.fleet import EnvFleet
from rollsafe.env.participant import MAX_LEASE_S
from rollsafe.env.protocol import MAX_RUN_LEASE_S, EpisodeRef, EpisodeResult, RunEpisode, RunLease
from rollsafe.errors import InvalidInput
from rollsafe.loop_thread import LoopThread

if TYPE_CHECKING:
    from rollsafe.settings import ParticipantsSection


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


def to_ref(episode: EpisodeId) -> EpisodeRef:
    return EpisodeRef(rollout_id=episode.rollout.key, attempt=episode.attempt)


def to_episode(ref: EpisodeRef) -> EpisodeId:
    return EpisodeId(RolloutId.parse(ref.rollout_id), ref.attempt)


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
