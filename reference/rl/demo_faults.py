"""How ``rollsafe demo`` plants its faults in a running run (see ``rollsafe.reference.rl.demo``).

What reacts to them (a replaced checkpoint worker, a restarted and restored run) stays in the
demo, which owns the processes; here are the parts that only poke the run from outside.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from rollsafe.evidence.files import FaultRecord
from rollsafe.faults import REACHED_SUFFIX
from rollsafe.reference.rl.controller import Endpoints
from rollsafe.reference.rl.demo_options import Fault
from rollsafe.reference.rl.run import ReferenceRun
from rollsafe.snapshot import SnapshotStore
from rollsafe.temporal.connect import ConnectionSettings, connect
from rollsafe.temporal.devserver import DevServer

Say = Callable[[str], None]
Clock = Callable[[], float]  # seconds since the demo started


def worker_fault_spec(
    coordinator: Fault | None, temporal: Fault | None, release: Path
) -> str | None:
    """The ``rollsafe.faults`` spec of a checkpoint worker: the first exits in the coordinator
    fault's phase; every one holds the first snapshot to reach the temporal fault's phase
    until ``release`` exists (once it does, the point lets every snapshot through)."""
    points = [f"worker.phase.{temporal.where}.before:until:{release}"] if temporal else []
    points += [f"worker.phase.{coordinator.where}.before:exit"] if coordinator else []
    return ",".join(points) or None


def crash_step(run_fault: Fault | None) -> int | None:
    """The 0-based step of ``run@step<k>`` (k counts from 1, as the demo prints steps)."""
    return int(run_fault.where[4:]) - 1 if run_fault else None


def kill_temporal_mid_snapshot(
    dev: DevServer, fault: Fault, release: Path, snapshots: SnapshotStore, say: Say, elapsed: Clock
) -> FaultRecord:
    """Once a snapshot is held in the fault's phase (its worker wrote ``<release>.reached``):
    the Temporal server SIGKILLed, started again on its state, the snapshot let go; returns
    once a snapshot published after it (the held one, gone on from its history)."""
    reached = Path(f"{release}{REACHED_SUFFIX}")

    def newest() -> int:  # retention removes old ones: their count need not grow
        return max((m.seq for m in snapshots.published_manifests()), default=0)

    _until(reached.exists, 120, f"a snapshot in {fault.where} (the temporal fault)")
    before = newest()  # the held snapshot has not published
    at = elapsed()
    dev.crash()
    say(f"[fault] the Temporal server is killed while a snapshot is in {fault.where} ({at:.1f}s)")
    asyncio.run(dev.start())  # the same state directory, port and SQLite file
    release.touch()
    _until(lambda: newest() > before, 180, "a snapshot published after the outage")
    return FaultRecord(
        kind="temporal",
        where=fault.where,
        at_s=at,
        recovered="the server started again on its state; the held snapshot went on and published",
        recovery_s=elapsed() - at,
    )


def _until(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the demo waited {timeout_s:g} s for {what}")
        time.sleep(0.05)


def snapshot_mid_generation(run: ReferenceRun, checkpointer: Any, say: Say, elapsed: Clock) -> None:
    """Snapshots while the step's calls generate, until one is published that cut a call. The
    engine holds the step's calls (``HoldRule``) after their first token until a cut, so the
    first snapshot after one is held cuts it, however loaded the machine is. The trainer first
    checkpoints its current weights if it has not: only an anchored snapshot is restored."""
    run.anchor_now()
    deadline = time.monotonic() + 30
    while run.loop.run(run.engine.info()).held == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(4):  # a snapshot a fault fails is taken again
        outcome = asyncio.run(checkpointer.snapshot_now(timeout=120))
        cut = sum(p.counts.get("cut", 0) for p in outcome.phases)
        say(
            f"[snapshot] {outcome.seq} {outcome.status} mid-generation, {cut} calls cut "
            f"({elapsed():.1f}s)"
        )
        # Below the prefix level nothing is cut on purpose: any published one will do.
        if outcome.status == "published" and (cut or run.settings.restore_level != "prefix"):
            return


def wait_for_kill_moment(
    generations: Path, snapshots: SnapshotStore, count: int, timeout_s: float = 60.0
) -> int:
    """Until ``count`` more seals are recorded in ``generations`` than at the call (the moment
    of a kill between snapshots) and the run has a published snapshot to be restored from
    (the first may have been skipped, its worker killed while a step committed), or
    ``timeout_s``; returns how many seals there were since the call."""

    def sealed() -> int:
        if not generations.exists():
            return 0
        return generations.read_text().count('"event":"sealed"')

    def ready() -> bool:
        return sealed() >= base + count and bool(snapshots.published_manifests())

    base, deadline = sealed(), time.monotonic() + timeout_s
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.02)
    return sealed() - base


def fail_env_checkpoint_calls(
    endpoints: Endpoints,
    checkpointer: Any,
    temporal: ConnectionSettings,
    run_id: str,
    say: Say,
    elapsed: Clock,
) -> FaultRecord:
    """w1 answers 503 to the checkpoint protocol until a snapshot's prepare failed on it
    (its workflow is then in ``resume``, retrying w1's resume): the other instances were
    resumed and refuse that checkpoint id forever, so the snapshot fails (transient) and
    the next one, once w1 answers again, publishes."""
    url = endpoints.envs["w1"]
    headers = {"authorization": f"Bearer {endpoints.env_token}"}
    httpx.post(f"{url}/faults", json={"unavailable": True}, headers=headers).raise_for_status()
    at = elapsed()
    say(f"[fault] environment w1 fails its checkpoint calls ({at:.1f}s)")
    outcomes: list[Any] = []
    snapshot = threading.Thread(
        target=lambda: outcomes.append(asyncio.run(checkpointer.snapshot_now(timeout=120)))
    )
    snapshot.start()
    try:
        asyncio.run(_until_a_snapshot_resumes(temporal, run_id))
    finally:
        httpx.post(f"{url}/faults", json={}, headers=headers).raise_for_status()
        snapshot.join()
    failed = outcomes[0]
    say(f"[snapshot] {failed.seq} {failed.status}: {failed.reason[:90]}")
    again = asyncio.run(checkpointer.snapshot_now(timeout=120))
    recovered = f"snapshot {failed.seq} {failed.status}; snapshot {again.seq} {again.status}"
    return FaultRecord(
        kind="env",
        where="prepare",
        at_s=at,
        recovered=f"{recovered} once w1 answered again",
        recovery_s=elapsed() - at,
    )


async def _until_a_snapshot_resumes(
    temporal: ConnectionSettings, run_id: str, timeout_s: float = 60.0
) -> None:
    from rollsafe.cli.inspection import inspect_run

    client = await connect(temporal)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = await inspect_run(client, run_id)
        if any(snapshot.phase == "resume" for snapshot in view.snapshots):
            return
        await asyncio.sleep(0.1)
