"""The checkpoint worker: hosts the snapshot workflows and their activities for a run.

With a health port, the worker answers HTTP probes (``--health-port``, docs/deploy.md):

- ``GET /healthz``: 200 while the worker polls its task queue; 503 while it is starting and
  once it is draining after SIGTERM/SIGINT (readiness, and "stop sending me work").
- ``GET /livez``: 200 from start to exit, through the drain; 503 only when the worker is
  neither starting nor draining and no longer polling (liveness).

Both answer 503 with status ``stuck`` once the worker's event loop or its channel to Ray has
not moved for a few seconds (:mod:`rollsafe.workers.watchdog`, which also exits a worker
stuck past ``stuck_exit_s``). They are served by a Starlette app under uvicorn on a thread
and event loop of their own, so a stuck worker still answers its probes. Any other path is a
404, any other method a 405.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import socket
import threading
from collections.abc import Callable, Generator, Iterator
from datetime import timedelta
from typing import Final, Literal

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from temporalio.client import Client
from temporalio.worker import Worker

from rollsafe.activities.controllers import ControllerResolver, RayControllerClient
from rollsafe.activities.snapshot import SnapshotActivities
from rollsafe.core.ids import task_queue_for
from rollsafe.faults import register
from rollsafe.http.served import server_config
from rollsafe.observability.telemetry import configure_telemetry
from rollsafe.temporal.connect import ConnectionSettings, connect
from rollsafe.versions import THIS
from rollsafe.workers.watchdog import (
    EXIT_AFTER_S,
    Watch,
    beat_loop,
    beat_ray,
    stuck,
    watchdog,
)
from rollsafe.workflows.restore import RestoreRun
from rollsafe.workflows.snapshot import RolloutSnapshot
from rollsafe.workflows.supervisor import SnapshotSupervisor

STICKY_TIMEOUT = timedelta(seconds=2)
# Reached once the worker has drained and stopped, before its process ends (`rollsafe
# worker`): its probes still answer there.
(WORKER_EXIT,) = register("worker.exit")

HealthState = Literal["starting", "serving", "draining"]
HealthPath = Literal["/healthz", "/livez"]
HEALTH_PATHS: Final[tuple[HealthPath, ...]] = ("/healthz", "/livez")


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
    """The worker's state as HTTP probes see it: read from the probes' own thread."""

    def __init__(self, run_id: str, task_queue: str) -> None:
        self.run_id = run_id
        self.task_queue = task_queue
        self.state: HealthState = "starting"
        self.worker: Worker | None = None
        self.watches: list[Watch] = []  # the event loop, the channel to Ray (watchdog)

    def polling(self) -> bool:
        return self.worker is not None and self.worker.is_running

    def answer(self, path: HealthPath) -> tuple[int, dict[str, object]]:
        """(HTTP status, JSON body) for a GET of ``path``."""
        polling = self.polling()
        stuck_on = stuck(self.watches)
        if stuck_on is not None:
            ok = False
        elif path == "/healthz":
            ok = self.state == "serving" and polling
        else:
            ok = self.state != "serving" or polling
        body: dict[str, object] = {
            "status": self.state if stuck_on is None else "stuck",
            "polling": polling,
            "run_id": self.run_id,
            "task_queue": self.task_queue,
        }
        if stuck_on is not None:
            body["stuck"] = stuck_on.describe()
        return (200 if ok else 503), body

    @contextlib.contextmanager
    def serving(self, host: str, port: int) -> Iterator[int]:
        """:meth:`serve` for the block: stopped, and its port closed, at its end."""
        server, sock, thread = self.serve(host, port)
        try:
            yield sock.getsockname()[1]
        finally:
            server.should_exit = True
            thread.join()
            sock.close()

    def serve(self, host: str, port: int) -> tuple[uvicorn.Server, socket.socket, threading.Thread]:
        """Serve :func:`health_app` on ``host:port`` (0: any free port) on a daemon thread
        and event loop of its own: a stuck worker still answers, and a worker answers until
        its process ends (``draining`` through its exit, never a refused connection). A port
        in use raises OSError here."""
        sock = _listen(host, port)
        server = _ProbeServer(server_config(health_app(self), host, port, lifespan="off"))
        # The socket already listens: a probe that comes before uvicorn accepts just waits.
        thread = threading.Thread(
            target=lambda: asyncio.run(server.serve(sockets=[sock])),
            name="rollsafe-worker-probes",
            daemon=True,  # never keeps a worker that exits
        )
        thread.start()
        return server, sock, thread


def health_app(health: WorkerHealth) -> Starlette:
    """``GET /healthz`` and ``GET /livez`` (HEAD too) answering ``health.answer``."""

    def probe(path: HealthPath) -> Route:
        async def endpoint(request: Request) -> JSONResponse:
            status, body = health.answer(path)
            return JSONResponse(body, status_code=status)

        return Route(path, endpoint, methods=["GET"])

    return Starlette(routes=[probe(path) for path in HEALTH_PATHS])


class _ProbeServer(uvicorn.Server):
    """uvicorn that leaves SIGINT and SIGTERM to the worker. ``serve`` would take them over
    for as long as it runs: the first signal would stop the probes instead of starting the
    drain (during which /healthz must answer 503 and /livez 200), and uvicorn re-raises it
    once it has stopped."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``, bound here rather than by uvicorn: a port in
    use is then an OSError for the caller (uvicorn would call sys.exit), and the port bound
    for 0 is known before serving starts."""
    family, _, _, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return socket.create_server(address, family=family)


async def run_worker(
    run_id: str,
    task_queue: str | None = None,
    settings: ConnectionSettings | None = None,
    ray_address: str | None = None,
    *,
    health_port: int | None = None,
    health_host: str = "0.0.0.0",
    drain_timeout_s: float = 0.0,
    stuck_exit_s: float = EXIT_AFTER_S,
) -> None:
    """Serve a run's checkpoint workflows until SIGINT/SIGTERM, then drain and stop.

    The controller is the run's named Ray actor in the cluster at ``ray_address`` (default:
    ``RAY_ADDRESS``, else the local cluster); any number of workers may serve one task queue.
    ``health_port`` (None: no probes; 0: any free port) serves ``/healthz`` and ``/livez``
    from before the worker connects until it exits; the port is printed once listening.
    ``drain_timeout_s``: how long activities in flight may finish after the signal before
    they are cancelled (0: at once). ``stuck_exit_s``: a worker whose event loop or channel
    to Ray has not moved for this long exits with STUCK_EXIT (0: never; the probes still say
    ``stuck``), for its supervisor to start a new one (rollsafe.workers.watchdog).
    """
    configure_telemetry()  # an entry point: the worker process's own providers
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
    loop_watch = Watch("event loop")
    health.watches.append(loop_watch)
    watching = threading.Event()
    exit_after = stuck_exit_s if stuck_exit_s > 0 else math.inf
    with contextlib.ExitStack() as stack:
        if health_port is not None:
            _, sock, _ = health.serve(health_host, health_port)  # to the process's end
            port = sock.getsockname()[1]
            print(f"rollsafe worker: health on http://{health_host}:{port}/healthz", flush=True)
        beats = asyncio.create_task(beat_loop(loop_watch))
        stack.callback(beats.cancel)
        stack.callback(watching.set)  # the watchdog (and the Ray beat) stop with the worker
        threading.Thread(
            target=watchdog,
            args=(health.watches, exit_after, watching),
            name="rollsafe-worker-watchdog",
            daemon=True,
        ).start()
        await _serve(
            run_id,
            queue,
            settings,
            ray_address,
            health,
            stop,
            drain_timeout_s,
            on_signals,
            watching,
        )
        await asyncio.sleep(0.1)  # sdk-python #300: let the worker's threads settle


async def _serve(  # noqa: PLR0913 (run_worker's options, passed on)
    run_id: str,
    queue: str,
    settings: ConnectionSettings | None,
    ray_address: str | None,
    health: WorkerHealth,
    stop: asyncio.Event,
    drain_timeout_s: float,
    on_signals: Callable[[], None],
    watching: threading.Event,
) -> None:
    import ray

    from rollsafe.checkpoint.actor import NAMESPACE, actor_name

    if not ray.is_initialized():
        ray.init(address=ray_address or "auto", namespace=NAMESPACE, log_to_driver=False)
        # ray.init installs its own SIGTERM handler (sys.exit: no drain): ours again.
        on_signals()
    ray_watch = Watch("channel to Ray")
    health.watches.append(ray_watch)
    threading.Thread(
        target=beat_ray,
        args=(ray_watch, lambda: ray.get_actor(actor_name(run_id), NAMESPACE), watching),
        name="rollsafe-worker-ray-beat",
        daemon=True,
    ).start()
    client = await connect(settings)
    if stop.is_set():  # stopped while connecting: never start polling
        return
    drain = timedelta(seconds=max(0.0, drain_timeout_s))
    worker = build_worker(client, queue, RayControllerClient, drain_timeout=drain)
    async with worker:
        health.worker = worker
        if health.state == "starting":
            health.state = "serving"
        joined = ray.get_runtime_context().gcs_address
        print(
            f"rollsafe worker: run {run_id!r}, task queue {queue!r}, Ray {joined}, "
            f"rollsafe {THIS.release} (contract {THIS.contract})",
            flush=True,
        )
        await stop.wait()
