"""A trainer restarted the way the docs say (docs/deploy.md section 4, docs/operations.md
"Restart a trainer") gets back everything it is owed, on real parts: a Temporal dev server,
a checkpoint worker, the run's controller as a Ray actor.

The trainer crashes and its controller actor goes with it; the run's supervisor lives on in
Temporal and keeps taking snapshots before the restarted trainer has restored. Each step
below is the recipe's, in its order: start the controller (``SyncRollouts.start(settings)``,
the same call as the first time), restore (``Checkpointer.restore`` with the trainer's
anchors), then ``start``; the run's own calls go through ``SyncRollouts`` over the actor.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from rollsafe.activities.controllers import RayControllerClient
from rollsafe.client import Checkpointer
from rollsafe.core.ids import task_queue_for
from rollsafe.evidence.scenario import row_content
from rollsafe.rollouts import SyncRollouts
from rollsafe.settings import Settings
from rollsafe.snapshot import EntryState, SnapshotStore
from rollsafe.temporal.connect import connect
from rollsafe.temporal.devserver import DevServer
from rollsafe.workers.checkpoint import build_worker
from rollsafe.workflows.models import PhaseOptions

ray = pytest.importorskip("ray")

OPTIONS = PhaseOptions(retry_initial_s=0.05, retry_maximum_s=0.2, retry_attempts=3)


def settings(run_id: str, root: Path) -> Settings:
    """What the trainer's config section says (docs/integrating.md)."""
    run = {"group_size": 2, "groups_per_step": 1}
    return Settings.load({"run_id": run_id, "snapshot_root": str(root), "run": run}, env={})


@asynccontextmanager
async def worker(client: Any, run_id: str) -> AsyncIterator[None]:
    """A checkpoint worker that reaches the controller actor by name, as `rollsafe worker`."""
    async with build_worker(client, task_queue_for(run_id), RayControllerClient):
        yield


def seal(rollouts: SyncRollouts, idx: int, i: int) -> None:
    episode = rollouts.dispatch(idx, i)
    rollouts.seal(idx, i, episode.attempt, row_content(idx, i, episode.attempt))


def train_one_step(rollouts: SyncRollouts, idx: int) -> None:
    """Group ``idx`` handed out, generated, trained: the weight version goes up by one."""
    rollouts.handout([idx])
    for i in range(2):
        seal(rollouts, idx, i)
    rollouts.claim([idx], idx)
    assert len(rollouts.rows([idx])[idx]) == 2
    rollouts.commit_step([idx])


def published(root: Path, run_id: str) -> set[str]:
    return {e.name for e in SnapshotStore(root, run_id).list() if e.state == EntryState.VALID}


def without_journal(tree: dict[str, str]) -> dict[str, str]:
    return {path: digest for path, digest in tree.items() if "/journal/" not in path}


def crash(rollouts: SyncRollouts) -> None:
    """The trainer's process dies, and its controller (an actor of its Ray job) with it."""
    ray.kill(rollouts.controller)


@pytest.mark.parametrize("start_over", [False, True], ids=["recipe", "start-over"])
async def test_the_restart_recipe_restores_every_owed_group(
    server: DevServer,
    ray_session: Any,
    tmp_path: Path,
    snapshot_tree: Callable[[Path], dict[str, str]],
    start_over: bool,
) -> None:
    client = await connect(server.settings())
    run_id = f"restart-{uuid.uuid4().hex[:8]}"
    root = tmp_path / "snapshots"
    async with worker(client, run_id):
        # The first life: 4 groups handed out, 3 rollouts sealed, one snapshot published.
        rollouts = SyncRollouts.start(settings(run_id, root))
        rollouts.handout([0, 1, 2, 3])
        for idx, i in ((0, 0), (0, 1), (1, 0)):
            seal(rollouts, idx, i)
        ckpt = await Checkpointer(run_id, client=client, options=OPTIONS).start()
        real = await ckpt.snapshot_now()
        assert real.status == "published" and real.published is not None
        crash(rollouts)

        # The restarted trainer starts its controller with the same call as the first time.
        rollouts = SyncRollouts.start(settings(run_id, root), start_over=start_over)
        try:
            assert rollouts.awaiting_restore() is not start_over
            before = snapshot_tree(root)
            # The supervisor outlived the crash: its periodic snapshots come before the restore.
            periodic = [await ckpt.snapshot_now() for _ in range(2)]
            restarted = Checkpointer(run_id, client=client, options=OPTIONS)
            plan = await restarted.restore(f"r-{uuid.uuid4().hex[:6]}")
            await restarted.start()
            owed = (plan.loader_position, plan.ready, sorted(plan.partial))
            if start_over:
                # The caller said the run begins again: nothing fences the empty controller,
                # its snapshots push the real one out, and nothing is owed back. This is what
                # every restart did before the fence, with no one having asked for it.
                assert [o.status for o in periodic] == ["published", "published"]
                assert real.published.name not in published(root, run_id)
                assert owed == (0, [], [])
                return
            for outcome in periodic:
                assert (outcome.status, outcome.error_type) == ("failed", "AwaitingRestore")
                assert outcome.transient and "has not restored one" in outcome.reason
            # The fenced snapshots changed nothing (the restore went on in a new journal segment).
            assert without_journal(snapshot_tree(root)) == without_journal(before)
            assert plan.snapshot == real.published.name
            assert owed == (4, [0], [1, 2, 3])
            assert plan.partial[1].restored == [0]

            # Restored: the run takes work again and its snapshots publish.
            rollouts.handout([4])
            after = await restarted.snapshot_now()
            assert after.status == "published", after.reason
            assert after.published is not None and after.published.loader_position == 5
            await restarted.stop()
        finally:
            crash(rollouts)


async def test_an_anchored_restore_finds_its_snapshot_after_many_newer_ones(
    server: DevServer, ray_session: Any, tmp_path: Path
) -> None:
    """The trainer checkpoints weight version 2; snapshots at versions 3-6 follow (twice the
    retention's keep_latest_k); after a crash the restore anchored to version 2 still has its
    snapshot. Once the trainer deletes that checkpoint, retention lets the snapshot go."""
    client = await connect(server.settings())
    run_id = f"anchors-{uuid.uuid4().hex[:8]}"
    root = tmp_path / "snapshots"
    async with worker(client, run_id):
        rollouts = SyncRollouts.start(settings(run_id, root))
        ckpt = await Checkpointer(run_id, client=client, options=OPTIONS).start()
        for idx in range(2):
            train_one_step(rollouts, idx)
        await ckpt.trainer_checkpoint_saved(2, "/ckpt/v2")
        anchored = await ckpt.snapshot_now()  # after the anchored one the signal queued
        assert anchored.published is not None and anchored.published.weight_version == 2
        for idx in range(2, 6):
            train_one_step(rollouts, idx)
            assert (await ckpt.snapshot_now()).status == "published"
        crash(rollouts)

        rollouts = SyncRollouts.start(settings(run_id, root))
        try:
            restarted = Checkpointer(run_id, client=client, options=OPTIONS)
            plan = await restarted.restore(f"r-{uuid.uuid4().hex[:6]}", weight_versions=[2])
            assert (plan.snapshot, plan.weight_version) == (anchored.published.name, 2)
            assert "its weight version 6 is past the trainer's 2" in str(plan.skipped)
            await restarted.start()

            # The journal brought back groups 2-5, their steps rolled back: ready, owed again.
            assert plan.ready == [2, 3, 4, 5] and plan.loader_position == 6
            await restarted.trainer_checkpoint_removed(2)
            rollouts.handout([6])
            assert (await restarted.snapshot_now()).status == "published"
            kept = published(root, run_id)
            assert anchored.published.name not in kept and len(kept) == 2
            await restarted.stop()
        finally:
            crash(rollouts)
