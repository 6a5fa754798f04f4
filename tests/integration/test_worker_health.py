"""The checkpoint worker's health endpoint: a real ``rollsafe worker`` process against
the session's Temporal dev server and Ray, the run's controller as its named actor.

``/healthz`` answers 200 while the worker polls; on SIGTERM it answers 503 while the worker
drains, the phase in flight finishes on the draining worker (``--drain-timeout``), and the
process exits 0. A second worker then finishes the snapshot from workflow history.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy

from rollsafe.checkpoint.actor import start_controller_actor
from rollsafe.cli.inspection import inspect_run, render
from rollsafe.core.config import RunConfig
from rollsafe.core.ids import snapshot_workflow_id, task_queue_for
from rollsafe.core.phases import PHASES, Phase, SnapshotSpec
from rollsafe.faults import ENV_VAR, REACHED_SUFFIX
from rollsafe.temporal.connect import connect
from rollsafe.temporal.devserver import DevServer
from rollsafe.testing.waiting import eventually_async
from rollsafe.workers.watchdog import STUCK_EXIT
from rollsafe.workflows.models import PhaseOptions, SnapshotInput, SnapshotOutcome
from rollsafe.workflows.snapshot import RolloutSnapshot

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60.0  # any one wait: generous on a loaded 2-core machine, still fails a hang
CAPTURE_S = 4.0  # how long capture takes in the controller: the drain window under test
HEALTH_LINE = re.compile(r"rollsafe worker: health on http://[^ ]+:(\d+)/healthz")
BANNER = "rollsafe worker: run"
# Every phase a regular activity: this tests how a draining worker finishes an activity in
# flight (capture); the park window's local activities end with the worker's workflow task.
OPTIONS = PhaseOptions(
    heartbeat_timeout_s=2, retry_initial_s=0.1, retry_maximum_s=0.5, local_park_window=False
)


async def waited(
    condition: Callable[[], Awaitable[Any] | Any], what: str, context: Callable[[], str]
) -> Any:
    """``condition``'s first truthy value within WAIT_S; a failure notes ``context()`` (the
    worker's log tail, the workflow's last description)."""
    try:
        return await eventually_async(condition, WAIT_S, what=what)
    except AssertionError as exc:
        exc.add_note(context())
        raise


class WorkerProcess:
    """One ``rollsafe worker`` subprocess in its own session, logging to a file; stopped by
    its pid (SIGTERM, then SIGKILL) when the test ends, even on failure."""

    def __init__(self, server: DevServer, ray_address: str, run_id: str, log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")}
        env.pop(ENV_VAR, None)
        env.update(
            TEMPORAL_ADDRESS=server.address,
            TEMPORAL_NAMESPACE=server.namespace,
            TEMPORAL_CONFIG_FILE=str(log.parent / "no-temporal-config.toml"),
            RAY_USAGE_STATS_ENABLED="0",
        )
        command = [sys.executable, "-m", "rollsafe", "worker", "--run", run_id]
        command += ["--ray-address", ray_address]
        self.log_path = log
        self.command = command
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *extra: str, fault: str | None = None) -> WorkerProcess:
        env = self.env if fault is None else {**self.env, ENV_VAR: fault}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [*self.command, *extra],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def describe(self) -> str:
        assert self.proc is not None
        text = self.log_path.read_text(errors="replace")
        return f"worker pid {self.pid}, exit code {self.proc.poll()}, log tail:\n{text[-3000:]}"

    async def line(self, pattern: re.Pattern[str] | str) -> re.Match[str] | str:
        """Wait for the log to show ``pattern`` (a regex or a plain substring)."""
        proc = self.proc
        assert proc is not None

        async def printed() -> re.Match[str] | str | None:
            text = self.log_path.read_text(errors="replace")
            if isinstance(pattern, str):
                if pattern in text:
                    return pattern
            elif (found := pattern.search(text)) is not None:
                return found
            if proc.poll() is not None:  # it never will
                raise AssertionError(f"exited without printing {pattern!r}")
            return None

        found: re.Match[str] | str = await waited(
            printed, f"the worker printed {pattern!r}", self.describe
        )
        return found

    async def exited(self) -> int:
        assert self.proc is not None
        try:
            return await asyncio.to_thread(self.proc.wait, WAIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {WAIT_S:g} s: {self.describe()}") from None

    async def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.proc.wait, 15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)


@pytest.fixture
def run_id() -> str:
    return f"health-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def controller(ray_session: Any, run_id: str, tmp_path: Path) -> Iterator[Any]:
    """The run's controller actor; its capture phase takes CAPTURE_S seconds."""
    slow = {"env_vars": {ENV_VAR: f"phase.capture.before:sleep:{CAPTURE_S:g}"}}
    config = RunConfig(run_id=run_id, group_size=2, groups_per_step=2)
    actor = start_controller_actor(run_id, config, tmp_path / "snapshots", runtime_env=slow)
    try:
        ray.get(actor.handout.remote([0, 1]))
        yield actor
    finally:
        ray.kill(actor)


class Workers:
    """The test's worker processes, all stopped at the end."""

    def __init__(self, server: DevServer, ray_address: str, run_id: str, logs: Path) -> None:
        self.args = (server, ray_address, run_id)
        self.logs = logs
        self.made: list[WorkerProcess] = []

    def make(self) -> WorkerProcess:
        worker = WorkerProcess(*self.args, self.logs / f"worker-{len(self.made)}.log")
        self.made.append(worker)
        return worker

    async def close(self) -> None:
        await asyncio.gather(*(worker.stop() for worker in self.made))


@pytest.fixture
async def workers(
    server: DevServer, ray_session: Any, run_id: str, tmp_path: Path
) -> AsyncIterator[Workers]:
    pool = Workers(server, ray_session.get_runtime_context().gcs_address, run_id, tmp_path)
    try:
        yield pool
    finally:
        await pool.close()


async def capture_started_by(handle: WorkflowHandle[Any, Any], pid: int) -> None:
    """Wait until the worker ``pid`` runs ``capture`` (its attempt has started)."""
    seen: list[Any] = []

    async def started() -> bool:
        description = await handle.describe()
        seen[:] = [description.raw_description]
        return any(
            pending.activity_type.name == Phase.CAPTURE.value
            and pending.last_worker_identity.startswith(f"{pid}@")
            and pending.HasField("last_started_time")
            for pending in description.raw_description.pending_activities
        )

    await waited(started, f"capture started on {pid}", lambda: f"last description: {seen}")


async def completed_by(handle: WorkflowHandle[Any, Any]) -> dict[str, tuple[int, int]]:
    """Activity name -> (attempt, worker pid) of the attempt that completed it."""
    names: dict[int, str] = {}
    attempts: dict[str, tuple[int, int]] = {}
    async for event in handle.fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes"):
            names[event.event_id] = (
                event.activity_task_scheduled_event_attributes.activity_type.name
            )
        elif event.HasField("activity_task_started_event_attributes"):
            started = event.activity_task_started_event_attributes
            pid = int(started.identity.split("@")[0])
            attempts[names[started.scheduled_event_id]] = (started.attempt, pid)
    return attempts


async def get(http: httpx.AsyncClient, port: int, path: str) -> httpx.Response:
    return await http.get(f"http://127.0.0.1:{port}{path}", timeout=5.0)


async def test_healthz_serves_while_polling_and_turns_503_while_a_sigterm_drains(
    server: DevServer, controller: Any, run_id: str, workers: Workers, tmp_path: Path
) -> None:
    client: Client = await connect(server.settings())
    leaving = tmp_path / "exit-hold"
    worker = workers.make().start(
        "--health-port", "0", "--health-host", "127.0.0.1", "--drain-timeout", "30",
        "--log-format", "json", fault=f"worker.exit:until:{leaving}",
    )  # fmt: skip
    found = await worker.line(HEALTH_LINE)
    assert isinstance(found, re.Match)
    port = int(found.group(1))

    async with httpx.AsyncClient() as http:
        # Serving: 200 once the worker polls its task queue (503, not polling, until then).
        async def serving() -> Any:
            response = await get(http, port, "/healthz")
            if response.status_code == 200:
                return response.json()
            assert response.status_code == 503, response.text
            assert response.json()["polling"] is False, response.text
            return None

        body = await waited(serving, "/healthz serving", worker.describe)
        assert body == {
            "status": "serving",
            "polling": True,
            "run_id": run_id,
            "task_queue": task_queue_for(run_id),
        }
        assert (await get(http, port, "/livez")).status_code == 200
        assert (await get(http, port, "/metrics")).status_code == 404
        assert (await http.post(f"http://127.0.0.1:{port}/healthz")).status_code == 405

        # A snapshot whose capture runs in the controller for CAPTURE_S seconds.
        handle = await client.start_workflow(
            RolloutSnapshot.run,
            SnapshotInput(spec=SnapshotSpec(run_id=run_id, seq=1), options=OPTIONS),
            id=snapshot_workflow_id(run_id, 1),
            task_queue=task_queue_for(run_id),
            id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
        )
        await capture_started_by(handle, worker.pid)

        # SIGTERM: draining, so 503 on /healthz (still alive on /livez) until capture ends.
        assert worker.proc is not None
        worker.proc.send_signal(signal.SIGTERM)

        async def not_serving() -> httpx.Response | None:
            response = await get(http, port, "/healthz")
            return response if response.status_code != 200 else None

        response = await waited(not_serving, "/healthz no longer 200", worker.describe)
        assert response.status_code == 503, response.text
        assert response.json()["status"] == "draining", response.text
        live = await get(http, port, "/livez")
        assert live.status_code == 200 and live.json()["status"] == "draining", live.text

        # Drained and stopped, its process not ended yet: the probes still answer.
        reached = Path(f"{leaving}{REACHED_SUFFIX}")
        await waited(reached.exists, "the worker at its exit", worker.describe)
        assert (await get(http, port, "/healthz")).status_code == 503
        live = await get(http, port, "/livez")
        assert live.status_code == 200 and live.json()["status"] == "draining", live.text
        leaving.touch()

    assert await worker.exited() == 0, worker.describe()
    # Drained: the phase in flight finished on the draining worker, first attempt.
    assert (await completed_by(handle))[Phase.CAPTURE.value] == (1, worker.pid)
    # --log-format json: the phases it ran are log lines, one JSON object each.
    logged = [
        json.loads(line)
        for line in worker.log_path.read_text().splitlines()
        if line.startswith("{")
    ]
    phases = [entry for entry in logged if entry.get("phase") == Phase.CAPTURE.value]
    assert phases and all(entry["level"] == "INFO" for entry in phases), logged[-5:]

    # Another worker on the queue finishes the snapshot from history; capture is not redone.
    successor = workers.make().start()
    await successor.line(BANNER)
    outcome: SnapshotOutcome = await asyncio.wait_for(handle.result(), WAIT_S)
    assert outcome.status == "published", outcome
    assert [result.phase for result in outcome.phases] == list(PHASES)
    assert not any(result.replayed for result in outcome.phases), outcome.phases


async def test_a_stuck_worker_says_so_is_named_by_inspect_and_exits_for_a_new_one(
    server: DevServer, controller: Any, run_id: str, workers: Workers, tmp_path: Path
) -> None:
    """The worker's event loop stops inside the park window (drain, a local activity, held
    on the loop's thread): its probes still answer, 503 ``stuck``; ``inspect`` names the
    worker holding the parked snapshot and, once the workflow task times out, that it timed
    out there; the worker exits (70) by itself and a new one finishes the snapshot."""
    client: Client = await connect(server.settings())
    hold = tmp_path / "drain-hold"
    stuck = workers.make().start(
        "--health-port", "0", "--health-host", "127.0.0.1", "--stuck-exit", "8",
        fault=f"worker.phase.drain.before:until:{hold}",
    )  # fmt: skip
    found = await stuck.line(HEALTH_LINE)
    assert isinstance(found, re.Match)
    port = int(found.group(1))
    await stuck.line(BANNER)
    options = PhaseOptions(retry_initial_s=0.1, retry_maximum_s=0.5, task_timeout_s=3)
    handle = await client.start_workflow(
        RolloutSnapshot.run,
        SnapshotInput(spec=SnapshotSpec(run_id=run_id, seq=1), options=options),
        id=snapshot_workflow_id(run_id, 1),
        task_queue=task_queue_for(run_id),
        task_timeout=timedelta(seconds=options.task_timeout_s),
    )
    reached = Path(f"{hold}{REACHED_SUFFIX}")
    await waited(reached.exists, "drain held on the worker's loop", stuck.describe)

    async with httpx.AsyncClient() as http:

        async def said_stuck() -> dict[str, Any] | None:
            answers = [await get(http, port, path) for path in ("/healthz", "/livez")]
            if all(a.status_code == 503 and a.json()["status"] == "stuck" for a in answers):
                said: dict[str, Any] = answers[0].json()
                return said
            return None

        body = await waited(said_stuck, "both probes say stuck", stuck.describe)
    assert body["stuck"].startswith("the worker's event loop has not moved for ")

    view = await inspect_run(client, run_id)
    [snap] = view.snapshots
    assert snap.worker is not None and snap.worker.startswith(f"{stuck.pid}@")
    assert snap.parked_since is not None  # admission closed: the window began
    # The window's upserts reached the server with the SDK's heartbeat of the workflow task
    # (80 % of its timeout), before it timed out: the phase the loop stopped in.
    assert snap.phase == Phase.DRAIN.value

    assert await stuck.exited() == STUCK_EXIT, stuck.describe()
    log = stuck.log_path.read_text(errors="replace")
    assert "has not moved for" in log and "exiting (70)" in log and "fault_point" in log

    async def timed_out_there() -> str | None:
        [snap] = (await inspect_run(client, run_id)).snapshots
        return (
            snap.task_trouble if snap.task_trouble and str(stuck.pid) in snap.task_trouble else None
        )

    trouble = await waited(timed_out_there, "inspect names the timed-out task", stuck.describe)
    assert trouble == f"timed out on worker {snap.worker}: start_to_close"
    assert f"held by worker {snap.worker}" in render(await inspect_run(client, run_id))

    successor = workers.make().start()  # what the worker's supervisor does on exit 70
    await successor.line(BANNER)
    outcome: SnapshotOutcome = await asyncio.wait_for(handle.result(), WAIT_S)
    assert outcome.status == "published", outcome
