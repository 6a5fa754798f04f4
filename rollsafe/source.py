"""The rollout source: the one object a trainer's loop pulls batches from (docs/integrating.md).

::

    async with rollsafe.RolloutSource(settings, task=task_for, to_row=to_row,
                                      weight_versions=my_checkpoints()) as source:
        policy.load(source.weight_version)            # the version the restore chose (0: new)
        await source.set_weights(policy.state_dict())  # the run's engines serve it
        while source.weight_version < steps:
            batch = await source.batch()              # a step's groups, claimed, and their rows
            policy.train(batch.rows)                   # your optimizer step
            path = policy.save(batch.step + 1)         # your checkpoint, whole or absent
            await source.step_done(batch.step + 1, path, weights=policy.state_dict())

The source owns what a loop over :class:`rollsafe.Rollouts` does by hand: it hands groups out
``ahead_steps`` steps ahead of training, dispatches every rollout the run owes through the
admission gate (a restored episode on the instance that holds it), runs it on the run's
environments (``task`` and ``to_row``) or with your own ``generate``, seals its row, evicts what
the sampler will never pick, and claims a step's groups. :meth:`RolloutSource.step_done`
commits the step, tells the checkpoint workflows, sends the new weights to the run's engines,
and anchors a snapshot at the trainer's checkpoint. The controller and a checkpoint worker live
in this process; the Temporal server and the participants are the settings'.

Restarting is constructing it again: a run that has snapshots is restored at construction to
the newest of the weight versions the trainer holds (``weight_versions``; the journal brings an
earlier snapshot forward to it), and :attr:`RolloutSource.weight_version` says which checkpoint
to load. :class:`SyncRolloutSource` has the same calls, blocking, for a loop that is not async.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from rollsafe.checkpoint.controller import Controller
from rollsafe.client import Checkpointer
from rollsafe.core.ids import EpisodeId, rollout_key
from rollsafe.core.phases import RestorePlan
from rollsafe.dataplane import Row
from rollsafe.engine.weights import WeightUpdatable
from rollsafe.env.protocol import EpisodeResult
from rollsafe.errors import CheckpointMismatch, InvalidInput, SnapshotsFailed
from rollsafe.evidence.files import GENERATIONS, TRAINED, RunReport
from rollsafe.evidence.recorder import EvidenceRecorder, trained_row
from rollsafe.loop_thread import LoopThread
from rollsafe.rollouts import Rollouts
from rollsafe.settings import Settings
from rollsafe.snapshot.location import open_snapshot_store

if TYPE_CHECKING:
    import torch

    from rollsafe.workflows.models import SnapshotOutcome

__all__ = ["Batch", "RolloutSource", "SyncRolloutSource"]

log = logging.getLogger(__name__)
Task = Callable[[int], Mapping[str, Any]]  # a dataset index -> its environment task
ToRow = Callable[[EpisodeResult], Row]
Generate = Callable[[EpisodeId], Awaitable[Row]]
# A new run's first snapshot is awaited this long: from it on, a restart always restores.
FIRST_SNAPSHOT_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 120.0  # close(): the supervisor's current snapshot ends within this


@dataclass(frozen=True)
class Batch:
    """One step's groups, claimed, and their training rows."""

    step: int  # the weight version this step trains from; its weights are ``step + 1``
    groups: tuple[int, ...]  # dataset indices, in the sampler's order
    rows: dict[int, list[Row]]  # each group's rows, in sibling order
    rollout_ids: dict[int, list[str]]  # each row's rollout id (its data-plane key)
    attempts: dict[int, list[int]]  # the attempt each row was sealed by


class RolloutSource:
    """A run's rollouts, as batches for a trainer's asyncio loop (module docstring). Use it as
    ``async with``: entering connects, restores and starts generating; leaving without an
    error ends the run's checkpointing cleanly (:meth:`close`), leaving on an error only lets
    go (the run's snapshots and journal stay for the restart)."""

    def __init__(  # noqa: PLR0913 (the source's options, keyword-only, each defaulted)
        self,
        settings: Settings | None = None,
        *,
        task: Task | None = None,
        to_row: ToRow | None = None,
        generate: Generate | None = None,
        weight_versions: Sequence[int] | None = None,
        ahead_steps: int = 1,
        start_over: bool = False,
        must_restore: bool = False,
        evidence: Path | str | None = None,
        run: Mapping[str, Any] | None = None,
    ) -> None:
        """``task`` and ``to_row``: a rollout is an episode on the run's environments
        (``participants:``), ``task(idx)`` the task of dataset index ``idx`` (the same every
        time: a regenerated rollout must get the same one), ``to_row(result)`` its training row.
        Or ``generate(episode)``: your own generation, returning the row. ``weight_versions``:
        those your checkpoints hold, for a restart's restore (``must_restore``: a run without
        snapshots is an error, not a new run: the trainer resumes). ``ahead_steps``: steps' worth of
        groups generated while the trainer trains one (0: none, a synchronous loop).
        ``evidence``: a directory for the run's evidence files (``rollsafe verify DIR``;
        rows then need a ``tokens`` field). ``run``: ``run:`` settings on top of the
        settings' (``{"group_size": 8}``)."""
        if (generate is None) == (task is None or to_row is None):
            raise InvalidInput(
                "give task= and to_row= (episodes on the run's environments), or generate="
            )
        if ahead_steps < 0:
            raise InvalidInput(f"ahead_steps is a number of steps >= 0, got {ahead_steps}")
        self.settings = settings if settings is not None else Settings.load()
        self.plan: RestorePlan | None = None  # what the restore gave back (None: a new run)
        self._task, self._to_row, self._generate = task, to_row, generate
        self._held = tuple(weight_versions) if weight_versions is not None else None
        self._ahead, self._start_over, self._run = ahead_steps, start_over, dict(run or {})
        self._must_restore = must_restore
        self._evidence = EvidenceRecorder(Path(evidence)) if evidence is not None else None
        self._outstanding: collections.deque[Batch] = collections.deque()
        self._running: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._failure: BaseException | None = None
        self._changed = asyncio.Event()  # wakes the dispatcher: a seal, a claim, a commit
        self._sealed = asyncio.Event()  # wakes batch(): a seal, or a failure
        self._waiting = False  # batch() waits for groups: hand them out even at ahead_steps=0
        self._engine_offsets: dict[str, int] = {}
        self._version = 0
        self._exit: contextlib.AsyncExitStack | None = None
        self._dispatcher: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        stack = contextlib.AsyncExitStack()
        try:
            await self._open(stack)
        except BaseException:
            await stack.aclose()
            raise
        self._exit = stack
        return self

    async def __aexit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            await self.close()
        else:
            await self.let_go()

    async def _open(self, stack: contextlib.AsyncExitStack) -> None:
        if not self._start_over:  # before the controller: a refusal writes nothing
            self._check_new_run()
        controller = Controller.from_settings(
            self.settings, start_over=self._start_over, **self._run
        )
        if controller.participants is not None:
            stack.callback(controller.participants.close)
        if self._generate is None and controller.participants is None:
            raise InvalidInput(
                "task= and to_row= run episodes on the run's environments, and the settings' "
                "participants: section names none; give generate= for your own generation"
            )
        self.controller, self.rollouts = controller, Rollouts(controller)
        self.checkpointer = Checkpointer(settings=self.settings)
        await stack.enter_async_context(self.checkpointer.worker(controller))
        if controller.status().awaiting_restore:
            await self._restore()
        else:
            await self._begin()
        await self.checkpointer.start()
        if self.plan is None:  # the run's first snapshot: from it on, a restart restores
            outcome = await self.checkpointer.snapshot_now(timeout=FIRST_SNAPSHOT_TIMEOUT_S)
            if outcome.status != "published":
                raise SnapshotsFailed(
                    self.run_id, outcome.error_type or "NotPublished", outcome.reason
                )
        self._version = await self.rollouts.weight_version()
        self._dispatcher = asyncio.create_task(self._dispatch_loop())

    async def _restore(self) -> None:
        if not self._held:
            raise InvalidInput(
                f"run {self.run_id!r} has snapshots: a restart restores it, so say which weight "
                "versions your checkpoints hold (weight_versions=[...]), or start the run over "
                "(start_over=True)"
            )
        self.plan = await self.checkpointer.restore(
            f"restart-{uuid.uuid4().hex[:8]}", weight_versions=self._held
        )
        if self.plan.weight_version not in self._held:
            raise CheckpointMismatch(
                f"run {self.run_id!r} restored to weight version {self.plan.weight_version} "
                f"(snapshot {self.plan.snapshot} and its journal reach no further), and no "
                f"checkpoint you hold is of it (weight_versions={list(self._held)}): resume "
                "from a checkpoint of that version"
            )
        if self._evidence is not None:
            self._evidence.restored(self.plan)
        log.info(
            "run %s restored from %s at weight version %d: %d groups ready, %d to generate",
            self.run_id,
            self.plan.snapshot,
            self.plan.weight_version,
            len(self.plan.ready),
            len(self.plan.redispatch),
        )

    async def _begin(self) -> None:
        """A new run (or one started over), at the newest weight version the trainer holds."""
        start = max(self._held or (0,))
        if start > 0:
            await self.rollouts.set_weight_version(start)

    def _check_new_run(self) -> None:
        """A run without snapshots is a new run: refused for a trainer that resumes
        (``must_restore``), and with evidence of an earlier run in the evidence directory."""
        root, run_id = self.settings.require_snapshot_root(), self.settings.require_run_id()
        store = open_snapshot_store(root, run_id, cache_dir=self.settings.snapshots.cache)
        if store.has_published():
            return
        if self._must_restore:
            raise CheckpointMismatch(
                f"run {run_id!r} has no snapshot under {root} to restore, and the trainer "
                f"resumes from weight version {max(self._held or (0,))}: check run_id and "
                "snapshot_root, or start a new run from the checkpoint"
            )
        for name in (TRAINED, GENERATIONS):
            path = self._evidence.out / name if self._evidence is not None else None
            if path is not None and path.exists() and path.stat().st_size > 0:
                raise InvalidInput(
                    f"{path} holds evidence of an earlier run {run_id!r}, but the run has no "
                    "snapshot to restore: use another evidence directory, or start_over=True"
                )

    async def close(self) -> None:
        """The run's end: episodes still running are let go, the supervisor finishes its
        snapshot and ends, the evidence (if any) gets its totals. Then as :meth:`let_go`."""
        await self._stop_episodes()
        await self.checkpointer.stop(wait=True, timeout=STOP_TIMEOUT_S)
        if self._evidence is not None:
            self._evidence.finish(self._report(), await self.rollouts.loader_position())
        await self.let_go()

    async def let_go(self) -> None:
        """Let go of everything this process holds, without ending the run's checkpointing
        (after an error): the run's snapshots, journal and supervisor stay for the restart."""
        await self._stop_episodes()
        if self._exit is not None:
            stack, self._exit = self._exit, None
            await stack.aclose()

    async def _stop_episodes(self) -> None:
        tasks = [t for t in (self._dispatcher, *self._running.values()) if t is not None]
        for running in tasks:
            running.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._dispatcher = None
        self._running.clear()

    # ---- what the trainer calls ------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return self.checkpointer.run_id

    @property
    def weight_version(self) -> int:
        """The weight version the next batch trains from: the restored one, then one more per
        :meth:`step_done`. Load your checkpoint of it after a restart."""
        return self._version + len(self._outstanding)

    async def batch(self) -> Batch:
        """The next step's groups, once the sampler picks them (waiting while they generate),
        claimed, with their rows. An episode's failure is raised here. Call again before
        :meth:`step_done` for the step after it (a trainer that prefetches)."""
        while True:
            self._raise_failure()
            if stale := await self.rollouts.stale():
                if self._evidence is not None:
                    self._evidence.evicted(self.weight_version, stale)
                await self.rollouts.evict(stale)
                log.info("run %s evicted stale groups %s", self.run_id, stale)
            if groups := await self.rollouts.select():
                break
            self._sealed.clear()
            self._waiting = True
            self._changed.set()
            try:
                await self._sealed.wait()
            finally:
                self._waiting = False
        step = self.weight_version
        await self.rollouts.claim(groups, step)
        rows = await self.rollouts.rows(groups)
        size = self.controller.state.config.group_size
        attempts = await asyncio.to_thread(
            lambda: {idx: [self.controller.attempt(idx, i) for i in range(size)] for idx in groups}
        )
        batch = Batch(
            step=step,
            groups=tuple(groups),
            rows=rows,
            rollout_ids={
                idx: [rollout_key(self.run_id, idx, i) for i in range(size)] for idx in groups
            },
            attempts=attempts,
        )
        self._outstanding.append(batch)
        self._changed.set()
        return batch

    async def step_done(
        self,
        version: int,
        checkpoint_path: str | Path | None = None,
        *,
        weights: Mapping[str, torch.Tensor] | None = None,
        wait: bool = True,
    ) -> SnapshotOutcome | None:
        """The optimizer step of the oldest batch not done committed, making weight version
        ``version`` (its ``step + 1``): its groups leave the run, the checkpoint workflows
        hear of it, ``weights`` (a state dict) go to the run's engines, and with
        ``checkpoint_path`` (your checkpoint of ``version``, saved before this call) a
        snapshot anchored to it is taken (:meth:`checkpoint_saved`)."""
        if not self._outstanding:
            raise InvalidInput(
                f"step_done({version}): no batch is being trained; call batch() first"
            )
        batch = self._outstanding[0]
        if version != batch.step + 1:
            raise InvalidInput(
                f"step_done({version}): the oldest batch not done trains step {batch.step}, "
                f"whose weights are version {batch.step + 1}"
            )
        if self._evidence is not None:  # before the commit: a restore rolls it back if need be
            self._evidence.trained(self._trained_rows(batch))
        await self.rollouts.commit_step(batch.groups)
        self._outstanding.popleft()
        self._version = version
        self._changed.set()
        told = self.checkpointer.train_step_committed(batch.step)
        if weights is None:
            await told
        else:  # one wait for both: neither needs the other
            await asyncio.gather(told, self._send_weights(weights, version))
        if checkpoint_path is None:
            return None
        return await self.checkpoint_saved(version, checkpoint_path, wait=wait)

    async def checkpoint_saved(
        self, version: int, path: str | Path, *, wait: bool = True
    ) -> SnapshotOutcome | None:
        """Your checkpoint of weight version ``version`` is saved (whole) at ``path``: a
        snapshot anchored to it, kept while you hold it (``wait``: returns its outcome;
        otherwise it is skipped if a step commits before it captures, and a restore brings an
        earlier snapshot forward with the journal instead)."""
        return await self.checkpointer.trainer_checkpoint_saved(version, str(path), wait=wait)

    async def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """The run's engines serve ``weights`` from now on, as :attr:`weight_version`'s (after
        a restart: the checkpoint you loaded)."""
        await self._send_weights(weights, self.weight_version)

    # ---- generation ------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        """Keep ``ahead_steps`` steps' worth of groups handed out besides those claimed (one
        step's while :meth:`batch` waits, at 0), and an episode running for every rollout the
        run owes."""
        per_step = self.controller.state.config.groups_per_step
        while True:
            self._changed.clear()
            claimed = sum(len(batch.groups) for batch in self._outstanding)
            ahead = max(self._ahead, 1 if self._waiting else 0)  # 0: only what batch() waits on
            wanted = per_step * ahead - (await self.rollouts.owned() - claimed)
            if wanted > 0:
                await self.rollouts.handout_next(wanted)
            for owed in await self.rollouts.owed():
                key = (owed.group, owed.sibling)
                if key not in self._running:
                    self._running[key] = asyncio.create_task(self._episode(*key, owed.owner))
            await self._changed.wait()

    async def _episode(self, group: int, sibling: int, owner: str | None) -> None:
        try:
            episode = await self.rollouts.dispatch(group, sibling, owner)
            if self._evidence is not None:
                self._evidence.generation("started", episode)
            if self._generate is not None:
                row = await self._generate(episode)
                await self.rollouts.seal(group, sibling, episode.attempt, row)
            else:
                assert self._task is not None and self._to_row is not None
                await self.rollouts.run_episode(episode, self._task(group), self._to_row)
            if self._evidence is not None:
                self._evidence.generation("sealed", episode)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # raised at the trainer's next batch()
            log.error("run %s: rollout %d of group %d failed: %r", self.run_id, sibling, group, exc)
            self._failure = self._failure or exc
        finally:
            self._running.pop((group, sibling), None)
            self._sealed.set()
            self._changed.set()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    # ---- helpers ---------------------------------------------------------------------------

    async def _send_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """``weights`` to every engine, as ``version`` unless an engine already served that
        number when first sent to (a lineage a restore rolled back, the base model at 0): then
        as a higher one, the same offset from rollsafe's versions from then on. The engine
        refuses a version it has passed, so an engine another trainer also updates is named
        at the next push."""
        participants = self.controller.participants
        if participants is None or not participants.engines:
            raise InvalidInput(
                "the settings' participants: section names no engine to send weights to"
            )

        async def send(name: str) -> None:
            engine = participants.engines[name]
            if not isinstance(engine, WeightUpdatable):
                raise InvalidInput(f"engine {name} takes no weights over its protocol")
            if name not in self._engine_offsets:  # asked once: each push then goes up by one
                served = (await engine.info()).weight_version
                self._engine_offsets[name] = max(0, served - version + 1)
            await engine.update_weights(weights, version + self._engine_offsets[name])

        async def send_all() -> None:
            await asyncio.gather(*(send(name) for name in participants.engines))

        done = asyncio.run_coroutine_threadsafe(send_all(), participants.loop.loop)
        await asyncio.wrap_future(done)

    def _trained_rows(self, batch: Batch) -> list[Any]:
        return [
            trained_row(batch.step, idx, rid, attempt, row)
            for idx in batch.groups
            for rid, attempt, row in zip(
                batch.rollout_ids[idx], batch.attempts[idx], batch.rows[idx], strict=True
            )
        ]

    def _report(self) -> RunReport:
        config = self.controller.state.config
        return RunReport(
            run_id=config.run_id,
            seed=0,
            steps=self._version,
            group_size=config.group_size,
            groups_per_step=config.groups_per_step,
            sampler=config.sampler,
            restore_level=config.restore_level,
            deterministic=False,
            journal=config.journal,
        )


class SyncRolloutSource:
    """:class:`RolloutSource` for a training loop that is not async: the same calls, blocking,
    from any thread (the source runs on an event loop of its own, on a thread). Constructing
    it connects and restores; :meth:`close` (or ``with``) ends the run cleanly."""

    def __init__(self, settings: Settings | None = None, **options: Any) -> None:
        """As :class:`RolloutSource`; ``generate`` stays a coroutine function (it runs on the
        source's loop)."""
        self.loop = LoopThread("rollsafe-source")
        self.source = RolloutSource(settings, **options)
        try:
            self.loop.run(self.source.__aenter__())
        except BaseException:
            self.loop.close()
            raise

    @property
    def plan(self) -> RestorePlan | None:
        return self.source.plan

    @property
    def run_id(self) -> str:
        return self.source.run_id

    @property
    def weight_version(self) -> int:
        return self.source.weight_version

    def batch(self) -> Batch:
        return self.loop.run(self.source.batch())

    def step_done(
        self,
        version: int,
        checkpoint_path: str | Path | None = None,
        *,
        weights: Mapping[str, torch.Tensor] | None = None,
        wait: bool = True,
    ) -> SnapshotOutcome | None:
        done = self.source.step_done(version, checkpoint_path, weights=weights, wait=wait)
        return self.loop.run(done)

    def checkpoint_saved(
        self, version: int, path: str | Path, *, wait: bool = True
    ) -> SnapshotOutcome | None:
        return self.loop.run(self.source.checkpoint_saved(version, path, wait=wait))

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.loop.run(self.source.set_weights(weights))

    def close(self) -> None:
        """As :meth:`RolloutSource.close`, then the source's loop ends."""
        try:
            self.loop.run(self.source.close())
        finally:
            self.loop.close()

    def let_go(self) -> None:
        """Let go without ending the run's checkpointing (after an error)."""
        try:
            self.loop.run(self.source.let_go())
        finally:
            self.loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.close()
        else:
            self.let_go()
