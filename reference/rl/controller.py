"""The reference run's controller: the run's ledger, replay index, data plane and admission
gate (``Controller``), its environments and engine (``Participants``), and the
dispatcher that drives episodes through the gate. Built from plain arguments, so it runs in
this process or as the run's named Ray actor, where the checkpoint workers find it.

The dispatcher lives here, beside the participants, on purpose: a snapshot's drain waits on
the dispatcher's own record of replies on the wire (``Participants.pending``), which must be
on the same event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from rollsafe.checkpoint.controller import Controller
from rollsafe.checkpoint.participants import Participants
from rollsafe.core.config import RunConfig
from rollsafe.core.ids import EpisodeId
from rollsafe.env.protocol import EpisodeResult
from rollsafe.evidence.recorder import record_generation
from rollsafe.reference.rl.workloads import WorkloadName, make_workload
from rollsafe.rollouts import Rollouts


class Endpoints(BaseModel):
    """Where the run's servers listen (one engine, environment instances by name)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_url: str
    engine_token: str
    envs: dict[str, str]
    env_token: str


class ReferenceController(Controller):
    def __init__(
        self,
        config: RunConfig,
        snapshot_root: Path | str,
        endpoints: Endpoints,
        turns: int,
        keep_latest_k: int = 8,
        *,
        start_over: bool = False,
        generations: str | None = None,
        workload: WorkloadName = "workplace",
    ) -> None:
        """``generations``: the evidence file each episode's start and seal are appended to
        (``rollsafe verify`` counts what crashes cost in generation from it); ``workload``:
        what the episodes are (:mod:`rollsafe.reference.rl.workloads`)."""
        self.workload = make_workload(workload, turns)
        self.generations = Path(generations) if generations else None
        participants = Participants.connect(
            endpoints.envs,
            {"engine": endpoints.engine_url},
            env_token=endpoints.env_token,
            engine_token=endpoints.engine_token,
        )
        self.loop = participants.loop
        super().__init__(
            config,
            snapshot_root,
            keep_latest_k=keep_latest_k,
            participants=participants,
            start_over=start_over,
        )
        self._running: dict[tuple[int, int], Future[None]] = {}
        self._dispatcher = _Dispatcher(self)

    # ---- generation ------------------------------------------------------------------------

    def generate(self, groups: Sequence[int] | None = None) -> int:
        """Start an episode for every unsealed sibling of ``groups`` (default: every group the
        run owns) that has none running here; returns how many were started."""
        with self.barrier:
            ledger = self.state.ledger
            wanted = ledger.groups() if groups is None else groups
            todo = [(idx, i) for idx in wanted for i in ledger.unsealed(idx)]
        self._running = {
            key: future
            for key, future in self._running.items()
            if not future.done() or (not future.cancelled() and future.exception() is not None)
        }
        todo = [key for key in todo if key not in self._running]
        for idx, i in todo:
            coroutine = self._dispatcher.episode(idx, i)
            self._running[(idx, i)] = asyncio.run_coroutine_threadsafe(coroutine, self.loop.loop)
        return len(todo)

    def next_groups(self, timeout_s: float) -> tuple[list[int], list[int]]:
        """Wait until the sampler picks a step's groups, or finds ready groups it will never
        pick (past the windowed sampler's staleness window); returns (picked, []) or
        ([], stale). Stale groups are not evicted here: the run records an eviction before
        asking for it (:meth:`evict`), so a crash in between cannot lose its record. An
        episode's failure is raised here."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.raise_failed()
            with self.barrier:
                stale = self.state.stale()
                picked = [] if stale else self.state.select()
            if stale or picked:
                return picked, stale
            if time.monotonic() >= deadline:
                raise TimeoutError(self._stuck(timeout_s))
            time.sleep(0.02)

    def raise_failed(self) -> None:
        """An episode's failure, raised here (the first one found)."""
        for future in self._running.values():
            if future.done() and not future.cancelled() and future.exception() is not None:
                future.result()

    def wait_episodes(self, timeout_s: float) -> None:
        """Until every episode started here has ended; a failure is raised, and so is
        :class:`TimeoutError` if some are still running after ``timeout_s``."""
        _, running = wait(list(self._running.values()), timeout_s)
        self.raise_failed()
        if running:
            raise TimeoutError(f"{len(running)} episodes still running after {timeout_s:g}s")

    def _stuck(self, timeout_s: float) -> str:
        status = self.status()
        with self.barrier:
            ledger = self.state.ledger
            states = {idx: [s.name for s in ledger.states(idx)] for idx in ledger.groups()}
        return (
            f"no step's groups ready after {timeout_s:g}s: {states}; "
            f"admission {'open' if status.gate_open else f'closed by {status.gate_holder}'}, "
            f"open checkpoint {status.open_checkpoint}"
        )

    def rollouts(self, groups: Sequence[int]) -> list[tuple[int, int, str, int]]:
        """(group, sibling, rollout id, attempt) of every rollout of ``groups``."""
        with self.barrier:
            ledger = self.state.ledger
            return [
                (idx, i, self.state.row_key(idx, i), ledger.attempt(idx, i))
                for idx in groups
                for i in range(self.state.config.group_size)
            ]

    def close(self) -> None:
        """Cancel the episodes still running and close the clients (a crashed run's episodes
        are lost anyway: the environments' own copies come back from the snapshot)."""
        for future in self._running.values():
            future.cancel()
        assert self.participants is not None
        self.participants.close()


class _Dispatcher:
    """The run's episodes as coroutines on the participants' loop. Not methods of
    :class:`ReferenceController` on purpose: Ray makes an actor with any ``async def`` method an
    asyncio actor whose synchronous methods all share one thread, so one blocking call (a
    trainer waiting for its episodes) would stall the checkpoint phases behind it."""

    def __init__(self, run: ReferenceController) -> None:
        self.run = run
        self.rollouts = Rollouts(run)

    async def episode(self, idx: int, i: int) -> None:
        """Dispatch through the gate (waiting while a snapshot holds it closed), run, seal."""
        episode = await self.rollouts.dispatch(idx, i)
        self._record("started", episode)
        owner = await asyncio.to_thread(self.run.instance_for, idx, i)
        workload = self.run.workload
        task = workload.task(idx)

        def to_row(result: EpisodeResult) -> dict[str, np.ndarray]:
            return workload.row(result, task, str(owner), episode.rollout.key)

        await self.rollouts.run_episode(episode, task, to_row, max_wait_s=120)
        self._record("sealed", episode)  # acknowledged: durable with the journal on

    def _record(self, event: Literal["started", "sealed"], episode: EpisodeId) -> None:
        if self.run.generations is not None:
            record_generation(self.run.generations, event, episode)
