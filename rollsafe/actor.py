"""The controller as a Ray actor, named per run (DESIGN.md section 4): the checkpoint phases of
:class:`~rollsafe.coordinator.CheckpointOps` plus the run's own operations, each of which
takes the capture barrier.

Ray is imported only when an actor is started or looked up, so the run's pure code and the
unit tests never pay for it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollsafe.config import RunConfig
from rollsafe.controller import Controller
from rollsafe.coordinator import CheckpointOps
from rollsafe.dataplane import Row, make_dataplane
from rollsafe.errors import InvalidInput, TransientError
from rollsafe.faults import fault_point, register
from rollsafe.gate import Clock
from rollsafe.ids import EpisodeId, validate_run_id
from rollsafe.participants import Participants
from rollsafe.snapshot import FAULT_POINTS
from rollsafe.snapshot.location import open_snapshot_store

if TYPE_CHECKING:
    from ray.actor import ActorHandle

NAMESPACE = "rollsafe"
# Calls run on this many threads: a resume must not queue behind a long phase. The locks in
# CheckpointOps and the barrier make that safe.
MAX_CONCURRENCY = 8


class ControllerNotFound(TransientError):
    """No controller actor for the run (yet): it may be starting or restarting."""


def actor_name(run_id: str) -> str:
    return f"rollsafe-controller-{validate_run_id(run_id)}"


class ControllerService(CheckpointOps):
    """One run's controller, built from plain arguments so Ray can construct it remotely."""

    def __init__(
        self,
        config: RunConfig,
        snapshot_root: Path | str,
        dataplane: str = "memory",
        keep_latest_k: int = 2,
        participants: Participants | None = None,
        *,
        start_over: bool = False,
        snapshot_cache: Path | str | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        # A path (a local disk or a shared POSIX mount) or object storage (s3://, gs://),
        # whose drafts are staged under ``snapshot_cache`` (docs/snapshot-format.md).
        store = open_snapshot_store(
            snapshot_root,
            config.run_id,
            cache_dir=snapshot_cache,
            keep_latest_k=keep_latest_k,
            fault_hook=_store_fault,
        )
        controller = Controller(config, make_dataplane(dataplane))
        super().__init__(
            controller, store, participants=participants, start_over=start_over, clock=clock
        )

    # The run's changes are refused (AwaitingRestore) while the controller awaits its restore.

    def handout(self, groups: Sequence[int]) -> None:
        """The data loader hands out these dataset indices (at or above the loader position,
        no repeats): each becomes a group of ``group_size`` rollouts, reserved at the current
        weight version; the loader position moves past the highest."""
        with self.changing("handout"):
            self.controller.handout(groups)

    def dispatch(self, idx: int, i: int, owner: str | None = None) -> EpisodeId | None:
        """Dispatch one attempt through the admission gate, in the same step that marks it
        DISPATCHED; None when the gate is closed (the attempt stays RESERVED, spends nothing)."""
        with self.changing("dispatch"), self.gate.admission() as admitted:
            return self.controller.dispatch(idx, i, owner) if admitted else None

    def seal(self, idx: int, i: int, attempt: int, row: Row) -> bool:
        """Commit rollout ``i`` of group ``idx`` (its dispatched ``attempt``): ``row`` is its
        training row, named numpy arrays (``rollsafe.dataplane.Row``), stored in the data
        plane under the rollout's key and digested. False when this exact seal was already
        applied (a retry); a different row for a sealed rollout is refused."""
        with self.changing("seal"):
            return self.controller.seal(idx, i, attempt, row)

    def claim(self, groups: Sequence[int], step: int) -> None:
        """The trainer takes these ready groups for ``step`` (its optimizer has not committed):
        a restore before :meth:`commit_step` gives them back as ready."""
        with self.changing("claim"):
            self.controller.claim(groups, step)

    def commit_step(self, groups: Sequence[int]) -> None:
        """The step that claimed ``groups`` committed: they leave the run for good (their rows
        are dropped) and the weight version goes up by one."""
        with self.changing("commit_step"):
            self.controller.commit_step(groups)

    def evict(self, groups: Sequence[int]) -> None:
        """Drop these ready groups on purpose (e.g. :meth:`stale` ones): never trained, never
        owed back. Record the eviction on your side first, so a crash cannot lose it."""
        with self.changing("evict"):
            for idx in groups:
                self.controller.evict(idx)

    def select(self) -> list[int]:
        """The ready groups the sampler picks for the next step (``groups_per_step`` of them),
        or [] while not enough are ready."""
        with self.barrier:
            return self.controller.select()

    def stale(self) -> list[int]:
        """Ready groups the sampler will never pick (past ``staleness_window``): evicting
        them is the run's call (:meth:`evict`)."""
        with self.barrier:
            return self.controller.stale()

    def loader_position(self) -> int:
        """The next dataset index to hand out (every index below it was handed out)."""
        with self.barrier:
            return self.controller.loader_position

    def attempt(self, idx: int, i: int) -> int:
        """The current attempt number of rollout ``i`` of group ``idx``."""
        with self.barrier:
            return self.controller.ledger.attempt(idx, i)


# Inside publish (SnapshotStore's own points), e.g. ROLLSAFE_FAULT=store.before_rename.
STORE_POINTS = register(*(f"store.{point}" for point in FAULT_POINTS))


def _store_fault(point: str) -> None:
    fault_point(f"store.{point}")


@functools.cache
def controller_actor_class() -> Any:
    import ray

    return ray.remote(ControllerService)


def start_controller_actor(
    run_id: str,
    config: RunConfig,
    snapshot_root: Path | str,
    namespace: str = NAMESPACE,
    *,
    dataplane: str = "memory",
    keep_latest_k: int = 2,
    runtime_env: dict[str, Any] | None = None,
    ray_options: Mapping[str, Any] | None = None,
    snapshot_cache: Path | str | None = None,
    start_over: bool = False,
) -> ActorHandle[ControllerService]:
    """The run's named controller actor, started if it is not running (get-if-exists: a
    second call gets the same actor and ignores its arguments). Not detached: it lives as
    long as the Ray job that started it. ``snapshot_root``: a path, or an object-storage URL
    (``s3://``, ``gs://``) whose drafts are staged under ``snapshot_cache``, a path on the
    nodes the actor may land on. ``ray_options``: further Ray actor options, e.g.
    where it runs (``{"resources": {"head_node": 0.01}}`` or a ``scheduling_strategy``);
    its name, namespace and get-if-exists are this function's own.

    If the run already has published snapshots, the new controller awaits its restore: it
    refuses work and snapshots (``AwaitingRestore``) until ``Checkpointer.restore`` has run,
    so a snapshot of its empty state can never displace the run's real one. ``start_over``:
    the run begins again from nothing instead (its old snapshots stay until retention)."""
    if config.run_id != run_id:
        raise InvalidInput(f"config is for run {config.run_id!r}, not {run_id!r}")
    reserved = sorted({"name", "namespace", "get_if_exists"} & set(ray_options or {}))
    if reserved:
        raise InvalidInput(f"ray_options may not set {', '.join(reserved)}")
    options: dict[str, Any] = {
        "name": actor_name(run_id),
        "namespace": namespace,
        "get_if_exists": True,
        "max_concurrency": MAX_CONCURRENCY,
        # Bookkeeping, not compute: it must schedule even when data-plane actors hold
        # every logical CPU (PLATFORM.md).
        "num_cpus": 0,
    }
    if runtime_env is not None:
        options["runtime_env"] = runtime_env
    options.update(ray_options or {})
    cls = controller_actor_class()
    cache = None if snapshot_cache is None else str(snapshot_cache)
    handle: ActorHandle[ControllerService] = cls.options(**options).remote(
        config,
        str(snapshot_root),
        dataplane,
        keep_latest_k,
        snapshot_cache=cache,
        start_over=start_over,
    )
    return handle


def get_controller_actor(run_id: str, namespace: str = NAMESPACE) -> ActorHandle[ControllerService]:
    import ray

    name = actor_name(run_id)
    try:
        handle: ActorHandle[ControllerService] = ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise ControllerNotFound(f"no actor {name!r} in Ray namespace {namespace!r}") from None
    return handle
