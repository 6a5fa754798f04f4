"""Killed checkpoint workers: a real Temporal dev server, a real Ray, the controller as
the run's named actor, workers as ``rollsafe worker`` subprocesses.

The crash matrix: a worker dies inside a phase (ROLLSAFE_FAULT ``worker.phase.<phase>.after``:
the controller did the phase and Temporal has not recorded it, the worst moment; ``.before``
for a subset), a new worker is started, and the snapshot must publish and verify, admission
must be open again, each phase's side effect must have happened once (counted by the
controller) and a restore must see the run as it was. Then two workers on one task queue: the
one running ``capture`` is killed with SIGKILL and the other finishes the snapshot.

Every worker is started in its own session and stopped by its pid when the test ends, even on
failure; every controller actor is killed through its handle.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import ResetStickyTaskQueueRequest
from temporalio.client import Client, WorkflowHandle

from rollsafe.checkpoint.actor import start_controller_actor
from rollsafe.checkpoint.controller import ControllerStatus
from rollsafe.core.config import RunConfig
from rollsafe.core.ids import snapshot_workflow_id, task_queue_for
from rollsafe.core.phases import PARK_WINDOW, PHASES, Phase, SnapshotSpec
from rollsafe.dataplane import make_dataplane
from rollsafe.evidence.scenario import row_content
from rollsafe.faults import ENV_VAR, EXIT_CODE
from rollsafe.snapshot import SnapshotStore, state_files
from rollsafe.temporal.connect import connect
from rollsafe.temporal.devserver import DevServer
from rollsafe.temporal.history import LOCAL_ACTIVITY_MARKER
from rollsafe.temporal.search_attributes import PHASE
from rollsafe.testing.history import completed_attempts
from rollsafe.testing.waiting import eventually_async
from rollsafe.testing.workers import stop_process, wait_worker_ready, worker_process
from rollsafe.workflows.models import PhaseOptions, SnapshotInput, SnapshotOutcome
from rollsafe.workflows.snapshot import RolloutSnapshot

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
# A dead worker's attempt is retried once its heartbeat times out: 2 s keeps each case short
# (docs/platform.md: the retry starts ~1.3-1.8 s after the kill).
# The park window's phases are local activities: a dead worker's workflow task is handed on
# after the task timeout, 2 s here too.
OPTIONS = PhaseOptions(
    heartbeat_timeout_s=2, task_timeout_s=2, retry_initial_s=0.1, retry_maximum_s=0.5
)
WAIT_S = 60.0  # any one wait: generous on a loaded 2-core machine, still fails a hang
# Phases with a side effect the controller counts; the others have nothing to do in a run
# without environments or engines, and must count zero.
COUNTED = {
    phase.value
    for phase in (Phase.OPEN, Phase.CLOSE_ADMISSION, Phase.CAPTURE, Phase.RESUME, Phase.PUBLISH)
}
# Every phase dies after its controller call; dying before it is the easier case, so a
# subset: the first phase, the one that writes the state, and the two that follow capture.
CASES = [(phase, "after") for phase in PHASES] + [
    (phase, "before") for phase in (Phase.OPEN, Phase.CAPTURE, Phase.RESUME, Phase.PUBLISH)
]


@pytest.fixture
async def client(server: DevServer) -> Client:
    return await connect(server.settings())


# ---- the run: its controller actor, seeded -------------------------------------------------


@dataclass
class Run:
    run_id: str
    config: RunConfig
    actor: Any
    store: SnapshotStore

    def status(self) -> ControllerStatus:
        status: ControllerStatus = ray.get(self.actor.status.remote())
        return status


@contextmanager
def controller_run(root: Path, runtime_env: dict[str, Any] | None = None) -> Iterator[Run]:
    """A fresh run id per test: its own actor, snapshot dir and task queue, so one failed
    case cannot leave a closed gate or an open checkpoint behind for the next."""
    run_id = f"crash-{uuid.uuid4().hex[:8]}"
    config = RunConfig(run_id=run_id, group_size=2, groups_per_step=2)
    actor = start_controller_actor(run_id, config, root, runtime_env=runtime_env)
    try:
        # Group 0 sealed in full, group 1 half, group 2 only handed out: a restore owes the
        # trainer group 0, keeps group 1's row and regenerates the rest.
        ray.get(actor.handout.remote([0, 1, 2]))
        for idx, i in ((0, 0), (0, 1), (1, 0)):
            episode = ray.get(actor.dispatch.remote(idx, i))
            ray.get(actor.seal.remote(idx, i, episode.attempt, row_content(idx, i, 0)))
        yield Run(run_id, config, actor, SnapshotStore(root, run_id))
    finally:
        ray.kill(actor)


# ---- worker processes ----------------------------------------------------------------------


class Workers:
    """``rollsafe worker`` subprocesses (``rollsafe.testing.raycluster.worker_process``), each
    in its own session and logging to a file (a full pipe would stall it)."""

    def __init__(self, server: DevServer, ray_address: str, logs: Path) -> None:
        self.settings = server.settings()
        self.ray_address = ray_address
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, run_id: str, fault: str | None = None) -> subprocess.Popen[bytes]:
        log = self.log_path(len(self.procs))
        proc = worker_process(run_id, self.settings, self.ray_address, log, cwd=REPO, fault=fault)
        self.procs.append(proc)
        return proc

    def log_path(self, n: int) -> Path:
        return self.logs / f"worker-{n}.log"

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        text = self.log_path(self.procs.index(proc)).read_text(errors="replace")
        return f"worker pid {proc.pid}, exit code {proc.poll()}, log tail:\n{text[-3000:]}"

    async def exited(self, proc: subprocess.Popen[bytes]) -> int:
        try:
            return await asyncio.to_thread(proc.wait, WAIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {WAIT_S:g} s: {self.log(proc)}") from None

    async def ready(self, proc: subprocess.Popen[bytes]) -> None:
        log = self.log_path(self.procs.index(proc))
        await asyncio.to_thread(wait_worker_ready, proc, log, WAIT_S)

    async def stop(self, proc: subprocess.Popen[bytes]) -> int:
        """SIGTERM, as an operator stops a worker; SIGKILL if it does not drain in time."""
        return await asyncio.to_thread(stop_process, proc, 10)

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(proc) for proc in self.procs))


@pytest.fixture
async def workers(server: DevServer, ray_session: Any, tmp_path: Path) -> AsyncIterator[Workers]:
    pool = Workers(server, ray_session.get_runtime_context().gcs_address, tmp_path)
    try:
        yield pool
    finally:
        await pool.close()


# ---- helpers -------------------------------------------------------------------------------


async def start_snapshot(
    client: Client, run: Run, options: PhaseOptions = OPTIONS
) -> WorkflowHandle[Any, SnapshotOutcome]:
    spec = SnapshotSpec(run_id=run.run_id, seq=1)
    return await client.start_workflow(
        RolloutSnapshot.run,
        SnapshotInput(spec=spec, options=options),
        id=snapshot_workflow_id(run.run_id, 1),
        task_queue=task_queue_for(run.run_id),
        task_timeout=timedelta(seconds=options.task_timeout_s),
    )


async def release_sticky_task(client: Client, handle: WorkflowHandle[Any, Any]) -> None:
    """Let any worker take the workflow's next task now. Temporal gives it to the worker that
    ran the previous one (its sticky queue) and, that worker being dead, moves it to the
    shared queue only after the SDK's 10 s sticky schedule-to-start timeout: latency, not
    correctness (the two-worker test waits it out), but 10 s per case here."""
    execution = WorkflowExecution(workflow_id=handle.id)
    await client.workflow_service.reset_sticky_task_queue(
        ResetStickyTaskQueueRequest(namespace=client.namespace, execution=execution)
    )


def check_published_once(run: Run, outcome: SnapshotOutcome) -> None:
    """The snapshot published and verifies, admission is open, every phase's effect happened
    exactly once, and a restore from it owes what the run owed."""
    assert outcome.status == "published", outcome
    assert [result.phase for result in outcome.phases] == list(PHASES)
    reader = run.store.select()  # the newest snapshot that fully verifies
    assert outcome.published is not None and reader.name == outcome.published.name
    assert reader.manifest.checkpoint_id == outcome.checkpoint_id
    assert len(run.store.list()) == 1

    status = run.status()
    assert status.gate_open and status.open_checkpoint is None, status
    assert status.effects == {key: int(key in COUNTED) for key in status.effects}, status
    # Open for real: a new attempt passes the gate.
    assert ray.get(run.actor.dispatch.remote(2, 0)) is not None

    _, plan = state_files.restore(run.config, run.store, make_dataplane("memory"))
    assert (plan.snapshot, plan.checkpoint_id) == (reader.name, outcome.checkpoint_id)
    assert plan.ready == [0] and sorted(plan.partial) == [1, 2]
    assert (plan.partial[1].restored, plan.partial[1].regenerate) == ([0], [1])
    assert plan.partial[2].regenerate == [0, 1]


# ---- the crash matrix ----------------------------------------------------------------------


@pytest.mark.parametrize(("phase", "when"), CASES, ids=[f"{w}-{p.value}" for p, w in CASES])
async def test_a_worker_killed_in_a_phase_is_replaced_and_the_snapshot_publishes_once(
    phase: Phase, when: str, client: Client, workers: Workers, tmp_path: Path
) -> None:
    with controller_run(tmp_path / "snapshots") as run:
        doomed = workers.start(run.run_id, fault=f"worker.phase.{phase.value}.{when}")
        handle = await start_snapshot(client, run)
        assert await workers.exited(doomed) == EXIT_CODE, workers.log(doomed)

        # The moment of the crash: after the call the controller holds the phase's result
        # and Temporal does not; before it the controller never heard of the phase.
        checkpoint_id = SnapshotSpec(run_id=run.run_id, seq=1).checkpoint_id
        done = run.status().done.get(checkpoint_id, [])
        assert (phase.value in done) == (when == "after"), done

        await release_sticky_task(client, handle)
        replacement = workers.start(run.run_id)
        outcome = await asyncio.wait_for(handle.result(), WAIT_S)
        check_published_once(run, outcome)

        # The retried phase got the stored result (after) or did the work (before). A phase
        # completed before the crash stays completed in history, with one exception: the park
        # window's local activities that the dead worker's workflow task ran but never
        # recorded run again on the replacement, and get their stored results too.
        attempts = await completed_attempts(handle)
        crashed_at = PHASES.index(phase)
        replayed = {r.phase: r.replayed for r in outcome.phases}
        for n, p in enumerate(PHASES):
            attempt, pid = attempts[p.value]
            if p == phase:
                assert (replayed[p], pid) == (when == "after", replacement.pid), p
            elif n > crashed_at:
                assert (replayed[p], pid) == (False, replacement.pid), p
            elif p in PARK_WINDOW:  # done before the crash: recorded then, or run again now
                assert replayed[p] == (pid == replacement.pid), p
                assert pid in (doomed.pid, replacement.pid), p
            else:
                assert (replayed[p], attempt, pid) == (False, 1, doomed.pid), p
            if p not in PARK_WINDOW and p == phase:
                assert attempt == 2, p  # a regular activity's retry: its heartbeat timed out
        assert await workers.stop(replacement) == 0, workers.log(replacement)


# ---- two workers on one task queue ---------------------------------------------------------


async def capture_holder(handle: WorkflowHandle[Any, Any]) -> int:
    """The pid of the worker running ``capture``, once it is mid-call: ``capture`` is a local
    activity in that worker's workflow task, and the phase shows (what an operator sees:
    `temporal workflow list --query "RollsafePhase='capture'"`) once the worker heartbeats
    that task, which it completes under its own identity."""
    seen: list[Any] = []

    async def holder() -> int | None:
        description = await handle.describe()
        seen[:] = [description.raw_description]
        if description.typed_search_attributes.get(PHASE) != Phase.CAPTURE.value:
            return None
        identity = ""
        async for event in handle.fetch_history_events():
            if event.HasField("workflow_task_completed_event_attributes"):
                identity = event.workflow_task_completed_event_attributes.identity
        return int(identity.split("@")[0])

    try:
        pid: int | None = await eventually_async(
            holder, WAIT_S, what="capture mid-call on a worker"
        )
    except AssertionError as exc:
        exc.add_note(f"last description: {seen}")
        raise
    assert pid is not None
    return pid


async def test_two_workers_on_one_queue_the_survivor_finishes_a_killed_capture(
    client: Client, workers: Workers, tmp_path: Path
) -> None:
    # Capture takes 4 s in the controller: past 80 % of the 2 s task timeout, so its worker
    # heartbeats the workflow task and the phase shows; time to kill that worker while its
    # call is still in the actor.
    slow = {"env_vars": {ENV_VAR: "phase.capture.before:sleep:4"}}
    with controller_run(tmp_path / "snapshots", runtime_env=slow) as run:
        pair = [workers.start(run.run_id), workers.start(run.run_id)]
        for proc in pair:  # both polling before the snapshot starts
            await workers.ready(proc)
        handle = await start_snapshot(client, run)

        holder_pid = await capture_holder(handle)
        [holder] = [proc for proc in pair if proc.pid == holder_pid]
        [survivor] = [proc for proc in pair if proc is not holder]
        os.kill(holder.pid, signal.SIGKILL)
        assert await workers.exited(holder) == -signal.SIGKILL

        # No sticky reset here: the survivor gets the workflow on its own, as in production.
        outcome = await asyncio.wait_for(handle.result(), WAIT_S)
        check_published_once(run, outcome)
        # The killed worker's call did the capture; the survivor's retry got its result.
        [capture] = [r for r in outcome.phases if r.phase == Phase.CAPTURE]
        assert capture.replayed
        attempts = await completed_attempts(handle)
        for later in (Phase.CAPTURE, Phase.RESUME, Phase.PUBLISH):
            assert attempts[later.value][1] == survivor.pid
        assert survivor.poll() is None, workers.log(survivor)


# ---- the admission lease -------------------------------------------------------------------

# Twice the heartbeat timeout: a live worker's phases renew it every second.
LEASED = OPTIONS.model_copy(update={"admission_lease_s": 4.0})


async def gate_reopened(run: Run) -> ControllerStatus:
    def reopened() -> ControllerStatus | None:
        status = run.status()
        return status if status.gate_open else None

    status: ControllerStatus | None = await eventually_async(
        reopened, WAIT_S, what="admission reopened by the lease"
    )
    assert status is not None
    return status


async def test_the_only_worker_dying_after_close_admission_reopens_it_by_the_lease(
    client: Client, workers: Workers, tmp_path: Path
) -> None:
    with controller_run(tmp_path / "snapshots") as run:
        doomed = workers.start(run.run_id, fault="worker.phase.close_admission.after")
        handle = await start_snapshot(client, run, LEASED)
        assert await workers.exited(doomed) == EXIT_CODE, workers.log(doomed)
        assert run.status().gate.closes == 1

        # No worker left: nobody renews the lease, and admission reopens by itself.
        status = await gate_reopened(run)
        assert (status.gate.expired, status.gate.opens) == (1, 0), status
        assert ray.get(run.actor.dispatch.remote(2, 0)) is not None

        # A worker comes back: the snapshot is abandoned as transient, nothing published.
        await release_sticky_task(client, handle)
        workers.start(run.run_id)
        outcome = await asyncio.wait_for(handle.result(), WAIT_S)
        assert (outcome.status, outcome.error_type, outcome.transient) == (
            "failed",
            "AdmissionLeaseExpired",
            True,
        ), outcome
        assert run.store.list() == []  # no draft left, nothing published
        status = run.status()
        assert status.gate_open and status.open_checkpoint is None
        assert status.effects[Phase.PUBLISH.value] == 0
        # Abandoned at once: the refused phase was not retried (ABANDONING_ERRORS).
        assert await failed_local_attempts(handle) == {Phase.RETIRE_DROPPED.value: 1}


async def failed_local_attempts(handle: Any) -> dict[str, int]:
    """Local activity (phase) -> the attempts it failed after, from the history's markers."""
    failed: dict[str, int] = {}
    async for event in handle.fetch_history_events():
        marker = event.marker_recorded_event_attributes
        if marker.marker_name == LOCAL_ACTIVITY_MARKER and marker.HasField("failure"):
            data = json.loads(marker.details["data"].payloads[0].data)
            failed[data["activity_type"]] = int(data["attempt"])
    return failed


async def test_a_phase_longer_than_the_lease_is_renewed_by_its_heartbeats(
    client: Client, workers: Workers, tmp_path: Path
) -> None:
    """The drain takes 6 s in the controller, past the 4 s lease: the worker's heartbeats
    renew it, so a live snapshot is never abandoned for being slow."""
    slow = {"env_vars": {ENV_VAR: "phase.drain.before:sleep:6"}}
    with controller_run(tmp_path / "snapshots", runtime_env=slow) as run:
        workers.start(run.run_id)
        handle = await start_snapshot(client, run, LEASED)
        outcome = await asyncio.wait_for(handle.result(), WAIT_S)
        check_published_once(run, outcome)
        assert run.status().gate.expired == 0
