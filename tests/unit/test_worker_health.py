"""The checkpoint worker's health endpoint (docs/deploy.md, "Health"): the app in-process for
each path and state, and ``WorkerHealth.serving`` on a real port. The whole worker, SIGTERM
and drain included, is tests/integration/test_worker_health.py."""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
from collections.abc import AsyncIterator
from typing import Any, cast

import httpx
import pytest

from rollsafe.workers.checkpoint import HealthState, WorkerHealth, health_app

RUN_ID, QUEUE = "run-7", "rollsafe.run-7"


class FakeWorker:
    """What the probes read of a Temporal worker."""

    def __init__(self, is_running: bool) -> None:
        self.is_running = is_running


def health_in(state: HealthState, worker: FakeWorker | None) -> WorkerHealth:
    health = WorkerHealth(RUN_ID, QUEUE)
    health.state = state
    health.worker = cast(Any, worker)
    return health


@contextlib.asynccontextmanager
async def probing(health: WorkerHealth) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``health_app(health)`` in-process: no socket, no server."""
    transport = httpx.ASGITransport(app=health_app(health))
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        yield client


# id -> (state, worker is_running or None: not built yet, /healthz, /livez), as the table in
# docs/deploy.md says: /healthz 200 only while serving and polling, /livez 503 only when
# serving without polling.
STATES = {
    "starting": ("starting", None, 503, 200),
    "starting-polling": ("starting", True, 503, 200),
    "serving": ("serving", True, 200, 200),
    "serving-not-polling": ("serving", False, 503, 503),
    "draining-polling": ("draining", True, 503, 200),
    "draining-stopped": ("draining", False, 503, 200),
}


@pytest.mark.parametrize(("state", "running", "healthz", "livez"), STATES.values(), ids=STATES)
async def test_each_path_answers_its_status_and_the_documented_body(
    state: HealthState, running: bool | None, healthz: int, livez: int
) -> None:
    health = health_in(state, None if running is None else FakeWorker(running))
    async with probing(health) as probe:
        for path, expected in (("/healthz", healthz), ("/livez", livez)):
            response = await probe.get(path)
            assert response.status_code == expected, (path, response.text)
            assert response.headers["content-type"] == "application/json"
            assert response.json() == {
                "status": state,
                "polling": bool(running),
                "run_id": RUN_ID,
                "task_queue": QUEUE,
            }


async def test_unknown_paths_are_404_other_methods_405_and_head_is_answered() -> None:
    async with probing(health_in("serving", FakeWorker(True))) as probe:
        for path in ("/", "/metrics", "/healthz/extra", "/livez.json"):
            assert (await probe.get(path)).status_code == 404, path
        assert (await probe.post("/healthz")).status_code == 405
        assert (await probe.delete("/livez")).status_code == 405
        head = await probe.head("/healthz")
        assert head.status_code == 200 and head.content == b""
        assert (await probe.get("/healthz?verbose=1")).status_code == 200


async def test_the_state_is_read_at_each_request() -> None:
    health = health_in("starting", None)
    async with probing(health) as probe:
        assert (await probe.get("/healthz")).status_code == 503
        health.worker, health.state = cast(Any, FakeWorker(True)), "serving"
        assert (await probe.get("/healthz")).status_code == 200
        health.state = "draining"
        response = await probe.get("/healthz")
        assert response.status_code == 503 and response.json()["status"] == "draining"


async def test_serving_binds_a_free_port_answers_on_it_and_leaves_the_signals_alone() -> None:
    health = health_in("serving", FakeWorker(True))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    async with health.serving("127.0.0.1", 0) as port, httpx.AsyncClient() as http:
        assert port > 0
        response = await http.get(f"http://127.0.0.1:{port}/healthz", timeout=5.0)
        assert response.status_code == 200 and response.json()["run_id"] == RUN_ID
        assert (await http.get(f"http://127.0.0.1:{port}/nope", timeout=5.0)).status_code == 404
        # SIGTERM still starts the worker's drain: uvicorn took no signal over.
        assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass


async def test_a_port_in_use_is_an_os_error() -> None:
    health = health_in("starting", None)
    async with health.serving("127.0.0.1", 0) as port:
        with pytest.raises(OSError) as raised:  # noqa: PT011 (its errno says which)
            async with health.serving("127.0.0.1", port):
                pass
        assert raised.value.errno == errno.EADDRINUSE
