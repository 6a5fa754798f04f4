"""The checkpoint worker: hosts the snapshot workflows and their activities for a run.

With a health port, the worker answers HTTP probes (``--health-port``, docs/deploy.md):

- ``GET /healthz``: 200 while the worker polls its task queue; 503 while it is starting and
  once it is draining after SIGTERM/SIGINT (readiness, and "stop sending me work").
- ``GET /livez``: 200 from start to exit, through the drain; 503 only when the worker is
  neither starting nor draining and no longer polling (liveness). Both are answered on the
  worker's event loop, so a loop blocked for longer than the probe's timeout fails them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Final, Literal

from temporalio.client import Client
from temporalio.worker import Worker

from rollsafe.activities.controllers import ControllerResolver, RayControllerClient
from rollsafe.activities.snapshot import SnapshotActivities
from rollsafe.core.ids import task_queue_for
from rollsafe.temporal.connect import ConnectionSettings, connect
from rollsafe.workflows.restore import RestoreRun
from rollsafe.workflows.snapshot import RolloutSnapshot
from rollsafe.workflows.supervisor import SnapshotSupervisor

STICKY_TIMEOUT = timedelta(seconds=2)

HealthState = Literal["starting", "serving", "draining"]
HEALTH_PATHS: Final = ("/healthz", "/livez")
_REQUEST_TIMEOUT_S = 5.0  # a probe that sends no complete request in this long is dropped
_MAX_REQUEST_BYTES = 8192


def build_worker(
    client: Client,
    task_queue: str,
    resolve: ControllerResolver,
    *,
    drain_timeout: timedelta = timedelta(),
) -> Worker:
    """``drain_timeout``: once a shutdown starts, how long activities in flight may run on
    before they are cancelled (zero, the SDK's default: at once; a cancelled phase is retried
    on another worker and gets the controller's stored result)."""
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[SnapshotSupervisor, RolloutSnapshot, RestoreRun],
        activities=SnapshotActivities(resolve).all(),
        # A killed worker's next workflow task waits on its dead sticky queue this long
        # before another worker takes it, with admission still closed: keep it short
        # (the SDK default is 10 s; replaying a snapshot's history costs milliseconds).
        sticky_queue_schedule_to_start_timeout=STICKY_TIMEOUT,
        graceful_shutdown_timeout=drain_timeout,
    )


class WorkerHealth:
    """The worker's state as HTTP probes see it; served on the worker's own event loop."""

    def __init__(self, run_id: str, task_queue: str) -> None:
        self.run_id = run_id
        self.task_queue = task_queue
        self.state: HealthState = "starting"
        self.worker: Worker | None = None

    def polling(self) -> bool:
        return self.worker is not None and self.worker.is_running

    def answer(self, path: str) -> tuple[int, dict[str, object]]:
        """(HTTP status, JSON body) for a GET of ``path``."""
        if path not in HEALTH_PATHS:
            return 404, {"error": f"no such path; known: {', '.join(HEALTH_PATHS)}"}
        polling = self.polling()
        if path == "/healthz":
            ok = self.state == "serving" and polling
        else:
            ok = self.state != "serving" or polling
        body: dict[str, object] = {
            "status": self.state,
            "polling": polling,
            "run_id": self.run_id,
            "task_queue": self.task_queue,
        }
        return (200 if ok else 503), body

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_REQUEST_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.close()
            return
        except ConnectionError:
            return
        method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        status, body = (
            self.answer(path) if method in ("GET", "HEAD") else (405, {"error": "GET or HEAD"})
        )
        payload = json.dumps(body).encode()
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}.get(
            status, "Service Unavailable"
        )
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + (payload if method != "HEAD" else b"")
        )
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    @contextlib.asynccontextmanager
    async def serving(self, host: str, port: int) -> AsyncIterator[int]:
        """Listen on ``host:port`` (0: any free port) for the block; yields the bound port."""
        server = await asyncio.start_server(
            self._handle, host, port, limit=_MAX_REQUEST_BYTES, reuse_address=True
        )
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 1.0)


async def run_worker(
    run_id: str,
    task_queue: str | None = None,
    settings: ConnectionSettings | None = None,
    ray_address: str | None = None,
    *,
    health_port: int | None = None,
    health_host: str = "0.0.0.0",
    drain_timeout_s: float = 0.0,
) -> None:
    """Serve a run's checkpoint workflows until SIGINT/SIGTERM, then drain and stop.

    The controller is the run's named Ray actor in the cluster at ``ray_address`` (default:
    ``RAY_ADDRESS``, else the local cluster); any number of workers may serve one task queue.
    ``health_port`` (None: no probes; 0: any free port) serves ``/healthz`` and ``/livez``
    from before the worker connects until it exits; the port is printed once listening.
    ``drain_timeout_s``: how long activities in flight may finish after the signal before
    they are cancelled (0: at once).
    """
    queue = task_queue or task_queue_for(run_id)
    health = WorkerHealth(run_id, queue)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def request_stop() -> None:
        health.state = "draining"
        stop.set()

    def on_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, request_stop)

    on_signals()
    async with contextlib.AsyncExitStack() as stack:
        if health_port is not None:
            port = await stack.enter_async_context(health.serving(health_host, health_port))
            print(f"rollsafe worker: health on http://{health_host}:{port}/healthz", flush=True)
        await _serve(
            run_id, queue, settings, ray_address, health, stop, drain_timeout_s, on_signals
        )
        await asyncio.sleep(0.1)  # sdk-python #300: let the worker's threads settle


async def _serve(
    run_id: str,
    queue: str,
    settings: ConnectionSettings | None,
    ray_address: str | None,
    health: WorkerHealth,
    stop: asyncio.Event,
    drain_timeout_s: float,
    on_signals: Callable[[], None],
) -> None:
    import ray

    from rollsafe.checkpoint.actor import NAMESPACE

    if not ray.is_initialized():
        ray.init(address=ray_address or "auto", namespace=NAMESPACE, log_to_driver=False)
        # ray.init installs its own SIGTERM handler (sys.exit: no drain): ours again.
        on_signals()
    client = await connect(settings)
    if stop.is_set():  # stopped while connecting: never start polling
        return
    drain = timedelta(seconds=max(0.0, drain_timeout_s))
    worker = build_worker(client, queue, RayControllerClient, drain_timeout=drain)
    async with worker:
        health.worker = worker
        if health.state == "starting":
            health.state = "serving"
        print(f"rollsafe worker: run {run_id!r}, task queue {queue!r}", flush=True)
        await stop.wait()
