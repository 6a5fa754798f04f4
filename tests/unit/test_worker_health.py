"""The checkpoint worker's health endpoint (docs/deploy.md, "Health"): the app in-process for
each path and state, and ``WorkerHealth.serving`` on a real port. The whole worker, SIGTERM
and drain included, is tests/integration/test_worker_health.py."""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any, cast

import httpx
import pytest

from rollsafe.testing.clock import HeldClock
from rollsafe.workers.checkpoint import HealthState, WorkerHealth, health_app
from rollsafe.workers.watchdog import (
    CHECK_S,
    EXIT_AFTER_S,
    STOPPED_EXIT_S,
    STUCK_AFTER_S,
    STUCK_EXIT,
    Watch,
    stuck,
    watchdog,
)

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
    with health.serving("127.0.0.1", 0) as port:
        http = httpx.AsyncClient()
        assert port > 0
        response = await http.get(f"http://127.0.0.1:{port}/healthz", timeout=5.0)
        assert response.status_code == 200 and response.json()["run_id"] == RUN_ID
        assert (await http.get(f"http://127.0.0.1:{port}/nope", timeout=5.0)).status_code == 404
        # SIGTERM still starts the worker's drain: uvicorn took no signal over.
        assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
        await http.aclose()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass


async def test_a_port_in_use_is_an_os_error() -> None:
    health = health_in("starting", None)
    with health.serving("127.0.0.1", 0) as port:
        with (
            pytest.raises(OSError) as raised,  # noqa: PT011 (its errno says which)
            health.serving("127.0.0.1", port),
        ):
            pass
        assert raised.value.errno == errno.EADDRINUSE


def test_a_watch_counts_stuck_time_only_while_the_watchdog_runs() -> None:
    clock = HeldClock()
    watch = Watch("event loop", clock)
    for _ in range(3):  # beating: never stuck
        watch.beat()
        clock.now += CHECK_S
        assert watch.check() == 0.0
    for _ in range(6):  # no beat for six checks
        clock.now += CHECK_S
        watch.check()
    assert watch.stuck_s == 6 * CHECK_S and stuck([watch]) is watch
    clock.now += 120.0  # the process was stopped (SIGSTOP) two minutes: one gap, not 120 s
    assert watch.check() == 6 * CHECK_S + 2 * CHECK_S
    watch.beat()
    clock.now += CHECK_S
    assert watch.check() == 0.0 and stuck([watch]) is None


def test_a_stopped_and_continued_worker_is_not_stuck_if_it_beats_again() -> None:
    clock = HeldClock()
    watch = Watch("event loop", clock)
    watch.beat()
    clock.now += 120.0  # stopped between a beat and the next check
    watch.beat()  # the loop runs first once continued
    assert watch.check() == 0.0


async def test_a_stuck_worker_answers_stuck_on_both_probes() -> None:
    clock = HeldClock()
    health = health_in("serving", FakeWorker(True))
    ray = Watch("channel to Ray", clock)
    health.watches = [Watch("event loop", clock), ray]
    async with probing(health) as probe:
        assert (await probe.get("/healthz")).status_code == 200
        for _ in range(int(STUCK_AFTER_S / CHECK_S)):
            clock.now += CHECK_S
            ray.check()
        for path in ("/healthz", "/livez"):
            answer = await probe.get(path)
            assert answer.status_code == 503
            assert answer.json()["status"] == "stuck"
            assert answer.json()["stuck"] == (
                f"the worker's channel to Ray has not moved for {STUCK_AFTER_S:.0f} s"
            )


class Ticking(threading.Event):
    """The watchdog's pause: each wait moves the clock on instead of sleeping."""

    def __init__(self, clock: HeldClock) -> None:
        super().__init__()
        self.clock = clock

    def wait(self, timeout: float | None = None) -> bool:
        self.clock.now += timeout or 0.0
        return False


def test_the_watchdog_exits_once_stuck_past_its_limit_logging_the_stack(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = HeldClock()
    watch = Watch("event loop", clock)
    watch.beat()  # from this thread: its stack is the one logged
    exited: list[int] = []
    watchdog([watch], 8 * CHECK_S, Ticking(clock), exited.append, clock)
    assert exited == [STUCK_EXIT] and watch.stuck_s == 8 * CHECK_S
    [record] = caplog.records
    assert record.getMessage().startswith(
        "the worker's event loop has not moved for 8 s: exiting (70)"
    )
    assert "test_the_watchdog_exits_once_stuck_past_its_limit" in record.getMessage()


class Stopping(Ticking):
    """As Ticking; the third pause lasts ``gap`` seconds, as a process stopped in it."""

    def __init__(self, clock: HeldClock, gap: float) -> None:
        super().__init__(clock)
        self.gap, self.pauses = gap, 0

    def wait(self, timeout: float | None = None) -> bool:
        self.pauses += 1
        self.clock.now += self.gap if self.pauses == 3 else timeout or 0.0
        return self.pauses > 6  # stop the watchdog after a few checks


@pytest.mark.parametrize(("gap", "exits"), [(STOPPED_EXIT_S + CHECK_S, True), (4.0, False)])
def test_a_worker_continued_after_a_long_stop_exits_at_once(
    caplog: pytest.LogCaptureFixture, gap: float, exits: bool
) -> None:
    clock = HeldClock()
    watch = Watch("event loop", clock)
    exited: list[int] = []
    watchdog([watch], EXIT_AFTER_S, Stopping(clock, gap), exited.append, clock)
    assert exited == ([STUCK_EXIT] if exits else [])
    if exits:
        assert (
            caplog.records[0]
            .getMessage()
            .startswith(
                f"the worker was stopped for {STOPPED_EXIT_S:.0f} s (SIGSTOP, a suspended machine)"
            )
        )
