"""The Temporal server SIGKILLed in the middle of a snapshot and started again on its state
(issue 22, part 1): the snapshot completes from the history with every phase's effect once,
admission reopens, the trainer SDK's calls during the outage raise TemporalUnavailable and
succeed after it, and ``rollsafe doctor`` and ``rollsafe inspect`` name the unreachable server.

A server of its own (the session's is shared), the controller and a worker in this process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollsafe.checkpoint.controller import Controller
from rollsafe.client import Checkpointer
from rollsafe.core.phases import PHASES, Phase
from rollsafe.dataplane import make_dataplane
from rollsafe.errors import TemporalUnavailable
from rollsafe.evidence.scenario import busy_run
from rollsafe.snapshot import SnapshotStore
from rollsafe.temporal.connect import connect
from rollsafe.temporal.devserver import DevServer
from rollsafe.testing.waiting import eventually_async, holding
from rollsafe.workflows.models import PhaseOptions, SnapshotOutcome

pytestmark = pytest.mark.timeout(300)

RUN = "outage"
FAST = PhaseOptions(retry_initial_s=0.05, retry_maximum_s=0.5, retry_attempts=5, task_timeout_s=2.0)
# The phases whose effect the controller counts (the others are bookkeeping or no-ops here).
COUNTED = {
    p.value for p in (Phase.OPEN, Phase.CLOSE_ADMISSION, Phase.CAPTURE, Phase.RESUME, Phase.PUBLISH)
}


async def published(ckpt: Checkpointer) -> SnapshotOutcome | None:
    """The supervisor's last outcome once a worker answers and it is a published snapshot."""
    status = await ckpt.status()
    last = status.supervisor.state.last_outcome if status.supervisor is not None else None
    return last if last is not None and last.status == "published" else None


def rollsafe_cli(*args: str, address: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")}
    env["TEMPORAL_ADDRESS"] = address
    return subprocess.run(
        [sys.executable, "-m", "rollsafe", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_a_temporal_server_killed_mid_snapshot_comes_back_and_the_snapshot_publishes_once(
    tmp_path: Path,
) -> None:
    dev = DevServer(tmp_path / "temporal")
    await dev.start()
    try:
        client = await connect(dev.settings())
        store = SnapshotStore(tmp_path, RUN)
        controller = Controller.from_parts(busy_run(RUN, make_dataplane("memory")), store)
        ckpt = Checkpointer(RUN, client=client, options=FAST, interval_s=3600)
        async with ckpt.worker(controller):
            await ckpt.start()
            with holding("phase.capture.before") as capture:  # inside the park window
                snapshot = asyncio.create_task(ckpt.snapshot_now())
                await capture.reached_async()
                await asyncio.to_thread(dev.crash)

                with pytest.raises(TemporalUnavailable, match=RUN):
                    await ckpt.status()
                # docs/deploy.md section 4: a checkpoint saved during the outage is held...
                with pytest.raises(TemporalUnavailable, match=RUN):
                    await ckpt.trainer_checkpoint_saved(0, "/ckpt/v0")
                with pytest.raises(TemporalUnavailable, match=RUN):
                    await ckpt.workers()
                for command in (["doctor"], ["inspect", RUN]):
                    done = await asyncio.to_thread(rollsafe_cli, *command, address=dev.address)
                    said = done.stdout + done.stderr
                    assert done.returncode == 1 and dev.address in said, (command, said)
                    assert "Traceback" not in said, said

                await dev.start()  # the same state dir, port and SQLite file
            # Released: the held capture finishes and the workflow goes on from its history.
            try:
                outcome = await asyncio.wait_for(snapshot, 120)
            except TemporalUnavailable:  # the call in flight saw the outage: ask again
                outcome = None
            # The restarted server knows the worker once its pollers (in backoff) come back.
            last: SnapshotOutcome | None = await eventually_async(
                lambda: published(ckpt), timeout_s=120, what="the supervisor reports it published"
            )
            assert last is not None
            assert outcome is None or outcome.checkpoint_id == last.checkpoint_id
            await ckpt.start()  # ...and sent by the recipe's start() once the server is back
            status = await ckpt.status()
            assert status.supervisor is not None and status.supervisor.state.anchors == [0]
            await ckpt.stop(wait=True, timeout=60)
        assert [r.phase for r in last.phases] == list(PHASES)
        assert last.published is not None and store.select().name == last.published.name
        assert len(store.list()) == 1
        state = controller.status()
        assert state.gate_open and state.open_checkpoint is None, state
        assert state.effects == {k: int(k in COUNTED) for k in state.effects}, state.effects
    finally:
        await asyncio.to_thread(dev.stop)
