"""The run side, for a framework's own rollout loop (docs/integrating.md).

A rollout loop (NeMo RL's, verl's, yours) keeps generating; rollsafe keeps the books. Each
call below goes to the run's controller: in this process, or the run's named Ray actor that
the checkpoint workers find too. The trainer side (snapshots, restore) is
:class:`rollsafe.Checkpointer`.

::

    rollouts = SyncRollouts.start(settings)          # the run's controller actor (Ray)
    for idx in rollouts.handout_next(32):            # dataset indices, each a group
        for i in range(group_size):
            episode = rollouts.dispatch(idx, i)      # waits while a snapshot parks the run
            row = generate(episode)                  # yours: the rollout's training row
            rollouts.seal(idx, i, episode.attempt, row)
    groups = rollouts.select()                       # a step's ready groups ([] until enough)
    rollouts.claim(groups, step)
    batch = rollouts.rows(groups)                    # read between claim and commit_step
    train(batch)                                     # yours: the optimizer step
    rollouts.commit_step(groups)                     # weight version + 1

:class:`Rollouts` has the same calls as coroutines, for an asyncio loop. After a restore
(:meth:`rollsafe.Checkpointer.restore`), :meth:`SyncRollouts.owed` lists what to generate again
and :meth:`SyncRollouts.select` picks the groups the restore gave back ready.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self, TypeVar

from rollsafe.checkpoint.controller import Controller, ControllerStatus, OwedRollout
from rollsafe.core.ids import EpisodeId
from rollsafe.dataplane import Row
from rollsafe.env.protocol import EpisodeResult
from rollsafe.errors import AdmissionClosed, InvalidInput
from rollsafe.settings import Settings

if TYPE_CHECKING:
    from ray.actor import ActorHandle

T = TypeVar("T")
# While admission is closed, a dispatch over Ray (or on an event loop) asks again after this
# long, doubling up to the maximum: a park window lasts about 0.1 s, and a waiting call must
# not hold one of the controller actor's threads, which the snapshot's own phases need to
# reopen admission. The maximum is what a dispatch may lag behind the reopening. A blocking
# dispatch on a controller in this process waits on the gate itself (woken when it opens).
ADMISSION_RETRY_FIRST_S = 0.005
ADMISSION_RETRY_MAX_S = 0.02
ADMISSION_WAIT_SLICE_S = 60.0  # without a timeout, the gate is waited on this long at a time
EPISODE_WAIT_S = 300.0  # run_episode: how long an episode may take, parked time included


class SyncRollouts:
    """The run's controller, called from a synchronous rollout loop (any thread)."""

    def __init__(self, controller: Controller | ActorHandle[Controller]) -> None:
        """``controller``: a :class:`Controller` in this process, or the run's actor (from
        :meth:`start`, or ``rollsafe.checkpoint.actor.get_controller_actor(run_id)``)."""
        self.controller = controller  # a Controller, or the run's actor handle
        self._local = isinstance(controller, Controller)

    @classmethod
    def start(
        cls,
        settings: Settings | None = None,
        *,
        start_over: bool = False,
        ray_options: Mapping[str, Any] | None = None,
        **run: Any,
    ) -> Self:
        """The run's controller actor, started (or found, if this Ray job already started
        it) from ``settings`` (default: :meth:`Settings.load`): its run id, snapshot root,
        data plane and ``run:`` section, with ``run`` keywords (``group_size=8``) on top.
        Joins Ray at ``settings.ray_address`` if this process has not. A run that already has
        snapshots gets a controller that awaits its restore (:meth:`awaiting_restore`) unless
        ``start_over``."""
        import ray

        from rollsafe.checkpoint.actor import NAMESPACE, start_controller_actor

        settings = settings if settings is not None else Settings.load()
        config = settings.run_config(**run)
        if not ray.is_initialized():
            ray.init(address=settings.ray_address, namespace=NAMESPACE)
        handle = start_controller_actor(
            config.run_id,
            config,
            settings.require_snapshot_root(),
            dataplane=settings.dataplane,
            keep_latest_k=settings.snapshots.keep_latest_k,
            snapshot_cache=settings.snapshots.cache,
            ray_options=ray_options,
            start_over=start_over,
        )
        return cls(handle)

    # ---- what the run owes -----------------------------------------------------------------

    def awaiting_restore(self) -> bool:
        """True for a fresh controller of a run that has snapshots: it takes no work until
        :meth:`rollsafe.Checkpointer.restore` ran (or it started over)."""
        return self.status().awaiting_restore

    def status(self) -> ControllerStatus:
        return self._call(Controller.status)

    def handout(self, groups: Sequence[int]) -> None:
        """Hand out these dataset indices (at or above :meth:`loader_position`, no repeats):
        each becomes a group of ``group_size`` rollouts at the current weight version."""
        self._call(Controller.handout, list(groups))

    def handout_next(self, count: int) -> list[int]:
        """Hand out the next ``count`` dataset indices from the loader position, and return
        them. Not atomic with other hand-outs: one loop hands out."""
        if count < 1:
            raise InvalidInput(f"handout_next needs a count >= 1, got {count}")
        start = self.loader_position()
        groups = list(range(start, start + count))
        self.handout(groups)
        return groups

    def owed(self) -> list[OwedRollout]:
        """Every rollout handed out and not sealed (group, sibling, attempt, owner): what to
        generate, e.g. after a restore. A restored episode names its environment instance
        (``owner``); dispatch it there to resume it."""
        return self._call(Controller.owed)

    # ---- generation ------------------------------------------------------------------------

    def try_dispatch(self, group: int, sibling: int, owner: str | None = None) -> EpisodeId | None:
        """Dispatch the rollout's next attempt if admission is open, else None (it stays
        reserved and nothing is spent)."""
        return self._call(Controller.dispatch, group, sibling, owner)

    def dispatch(
        self,
        group: int,
        sibling: int,
        owner: str | None = None,
        *,
        timeout_s: float | None = None,
    ) -> EpisodeId:
        """Dispatch the rollout's next attempt through the admission gate and return its
        episode id (``.attempt`` is the attempt to seal). While a snapshot holds admission
        closed, waits (the park window, about 0.1 s); :class:`AdmissionClosed` after
        ``timeout_s`` (None: wait as long as it takes)."""
        deadline = _deadline(timeout_s)
        wait = ADMISSION_RETRY_FIRST_S
        while (episode := self.try_dispatch(group, sibling, owner)) is None:
            if self._local:
                assert isinstance(self.controller, Controller)
                _check_deadline(0.0, deadline, group, sibling)
                left = None if deadline is None else deadline - time.monotonic()
                self.controller.gate.wait_open(ADMISSION_WAIT_SLICE_S if left is None else left)
                continue
            _check_deadline(wait, deadline, group, sibling)
            time.sleep(wait)
            wait = min(wait * 2, ADMISSION_RETRY_MAX_S)
        return episode

    def run_episode(
        self,
        episode: EpisodeId,
        task: Mapping[str, Any],
        to_row: Callable[[EpisodeResult], Row],
        *,
        max_wait_s: float = EPISODE_WAIT_S,
    ) -> EpisodeResult:
        """For a run whose environments are the controller's participants (a controller in
        this process, :meth:`rollsafe.checkpoint.participants.Participants.connect`): run the
        dispatched ``episode`` on its environment instance with ``task``, then seal
        ``to_row(result)``. A snapshot parks it, cuts its model calls and drains its reply;
        after a restore the same call resumes it where the snapshot left it."""
        return self._episode(episode, task, to_row, max_wait_s).result()

    def _episode(
        self,
        episode: EpisodeId,
        task: Mapping[str, Any],
        to_row: Callable[[EpisodeResult], Row],
        max_wait_s: float,
    ) -> concurrent.futures.Future[EpisodeResult]:
        controller = self.controller
        if not isinstance(controller, Controller) or controller.participants is None:
            raise InvalidInput(
                "run_episode needs the run's controller in this process, with participants "
                "(Controller(..., participants=Participants.connect(...))); otherwise run the "
                "episode yourself and seal its row"
            )
        participants = controller.participants
        idx, i = episode.rollout.group.idx, episode.rollout.i
        instance = controller.instance_for(idx, i)
        assert instance is not None  # a run with participants places every rollout

        def seal(result: EpisodeResult) -> None:
            controller.seal(idx, i, episode.attempt, to_row(result))

        running = participants.run_episode(episode, instance, task, seal, max_wait_s=max_wait_s)
        return asyncio.run_coroutine_threadsafe(running, participants.loop.loop)

    def seal(self, group: int, sibling: int, attempt: int, row: Row) -> bool:
        """Commit the rollout's training row (named numpy arrays) for its dispatched
        ``attempt``. Idempotent: False when this exact seal was already applied; a different
        row for a sealed rollout is refused (:class:`rollsafe.errors.SealConflict`)."""
        return self._call(Controller.seal, group, sibling, attempt, row)

    # ---- training --------------------------------------------------------------------------

    def select(self) -> list[int]:
        """The ready groups the sampler picks for the next step, or [] while too few are."""
        return self._call(Controller.select)

    def stale(self) -> list[int]:
        """Ready groups the sampler will never pick (past the staleness window): evict them
        (:meth:`evict`) after recording that you do."""
        return self._call(Controller.stale)

    def claim(self, groups: Sequence[int], step: int) -> None:
        """This step takes ``groups``: a restore before :meth:`commit_step` gives them back
        ready."""
        self._call(Controller.claim, list(groups), step)

    def rows(self, groups: Sequence[int]) -> dict[int, list[Row]]:
        """The claimed groups' rows, each group's in sibling order; read them before
        :meth:`commit_step`."""
        return self._call(Controller.rows, list(groups))

    def commit_step(self, groups: Sequence[int]) -> None:
        """The step that claimed ``groups`` committed: they leave the run, their rows are
        dropped, and the weight version goes up by one."""
        self._call(Controller.commit_step, list(groups))

    def evict(self, groups: Sequence[int]) -> None:
        """Drop these ready groups for good (never trained, never owed back)."""
        self._call(Controller.evict, list(groups))

    def owned(self) -> int:
        """Groups handed out and neither trained nor evicted."""
        return self._call(Controller.owned)

    def weight_version(self) -> int:
        """The number of steps committed (plus any :meth:`set_weight_version`)."""
        return self._call(Controller.weight_version)

    def set_weight_version(self, version: int) -> None:
        """Move the weight version up (never down), for a policy that changes other than one
        step at a time."""
        self._call(Controller.set_weight_version, version)

    def loader_position(self) -> int:
        """The next dataset index to hand out (after a restore: the plan's)."""
        return self._call(Controller.loader_position)

    # ---- transport -------------------------------------------------------------------------

    def _call(self, method: Callable[..., T], *args: Any) -> T:
        if self._local:
            return method(self.controller, *args)
        import ray

        remote = getattr(self.controller, method.__name__).remote
        result: T = ray.get(remote(*args))
        return result


class Rollouts:
    """The same calls as :class:`SyncRollouts`, as coroutines for an asyncio rollout loop:
    each runs on a worker thread, so the loop never blocks on the controller."""

    def __init__(self, controller: Controller | ActorHandle[Controller]) -> None:
        self.sync = SyncRollouts(controller)

    @classmethod
    def start(
        cls,
        settings: Settings | None = None,
        *,
        start_over: bool = False,
        ray_options: Mapping[str, Any] | None = None,
        **run: Any,
    ) -> Self:
        """As :meth:`SyncRollouts.start` (a blocking call: run it before the loop starts)."""
        started = SyncRollouts.start(
            settings, start_over=start_over, ray_options=ray_options, **run
        )
        return cls(started.controller)

    async def awaiting_restore(self) -> bool:
        return (await self.status()).awaiting_restore

    async def status(self) -> ControllerStatus:
        return await asyncio.to_thread(self.sync.status)

    async def handout(self, groups: Sequence[int]) -> None:
        await asyncio.to_thread(self.sync.handout, groups)

    async def handout_next(self, count: int) -> list[int]:
        return await asyncio.to_thread(self.sync.handout_next, count)

    async def owed(self) -> list[OwedRollout]:
        return await asyncio.to_thread(self.sync.owed)

    async def try_dispatch(
        self, group: int, sibling: int, owner: str | None = None
    ) -> EpisodeId | None:
        return await asyncio.to_thread(self.sync.try_dispatch, group, sibling, owner)

    async def dispatch(
        self,
        group: int,
        sibling: int,
        owner: str | None = None,
        *,
        timeout_s: float | None = None,
    ) -> EpisodeId:
        """As :meth:`SyncRollouts.dispatch`; waits on the event loop, not a thread."""
        deadline = _deadline(timeout_s)
        wait = ADMISSION_RETRY_FIRST_S
        while (episode := await self.try_dispatch(group, sibling, owner)) is None:
            _check_deadline(wait, deadline, group, sibling)
            await asyncio.sleep(wait)
            wait = min(wait * 2, ADMISSION_RETRY_MAX_S)
        return episode

    async def run_episode(
        self,
        episode: EpisodeId,
        task: Mapping[str, Any],
        to_row: Callable[[EpisodeResult], Row],
        *,
        max_wait_s: float = EPISODE_WAIT_S,
    ) -> EpisodeResult:
        """As :meth:`SyncRollouts.run_episode`."""
        return await asyncio.wrap_future(self.sync._episode(episode, task, to_row, max_wait_s))

    async def seal(self, group: int, sibling: int, attempt: int, row: Row) -> bool:
        return await asyncio.to_thread(self.sync.seal, group, sibling, attempt, row)

    async def select(self) -> list[int]:
        return await asyncio.to_thread(self.sync.select)

    async def stale(self) -> list[int]:
        return await asyncio.to_thread(self.sync.stale)

    async def claim(self, groups: Sequence[int], step: int) -> None:
        await asyncio.to_thread(self.sync.claim, groups, step)

    async def rows(self, groups: Sequence[int]) -> dict[int, list[Row]]:
        return await asyncio.to_thread(self.sync.rows, groups)

    async def commit_step(self, groups: Sequence[int]) -> None:
        await asyncio.to_thread(self.sync.commit_step, groups)

    async def evict(self, groups: Sequence[int]) -> None:
        await asyncio.to_thread(self.sync.evict, groups)

    async def owned(self) -> int:
        return await asyncio.to_thread(self.sync.owned)

    async def weight_version(self) -> int:
        return await asyncio.to_thread(self.sync.weight_version)

    async def set_weight_version(self, version: int) -> None:
        await asyncio.to_thread(self.sync.set_weight_version, version)

    async def loader_position(self) -> int:
        return await asyncio.to_thread(self.sync.loader_position)


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def _check_deadline(wait: float, deadline: float | None, group: int, sibling: int) -> None:
    """:class:`AdmissionClosed` if waiting ``wait`` more would pass the deadline."""
    if deadline is not None and time.monotonic() + wait > deadline:
        raise AdmissionClosed(
            f"rollout {sibling} of group {group}: admission stayed closed past the dispatch "
            "timeout (a snapshot parks the run); it stays reserved: dispatch it again"
        )
