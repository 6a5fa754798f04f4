"""Waiting in tests and drills on a condition or an event, never on the clock alone.

- :func:`eventually` / :func:`eventually_async`: wait until a condition holds, with a deadline
  that fails the test naming what never happened (sdk-python's ``assert_eventually``). Use it
  for state that changes by itself (a server that lists a poller, a file that appears).
- :func:`holding`: arm a named fault point with ``hold`` (:mod:`rollsafe.faults`) so the code
  stops *there*, wait until a thread reached it, act while it is held (abort a phase, cut a
  call mid-generation), then release it. Nothing is timed: the code is caught where the test
  needs it on an idle machine and on a loaded one alike.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar, overload

from rollsafe import faults

T = TypeVar("T")
POLL_S = 0.01  # how often a condition is looked at: the wait ends at most this much late
DEFAULT_TIMEOUT_S = 30.0  # a deadline for a failure message, never for synchronisation


def eventually(
    condition: Callable[[], T | None], timeout_s: float = DEFAULT_TIMEOUT_S, what: str = ""
) -> T:
    """Return ``condition()``'s first truthy value; fail (AssertionError naming ``what``) if
    none came within ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s} s: {what or _name(condition)}")
        time.sleep(POLL_S)


@overload
async def eventually_async(
    condition: Callable[[], Awaitable[T | None]],
    timeout_s: float = ...,
    what: str = ...,
) -> T: ...
@overload
async def eventually_async(
    condition: Callable[[], T | None],
    timeout_s: float = ...,
    what: str = ...,
) -> T: ...
async def eventually_async(
    condition: Callable[[], Awaitable[T | None] | T | None],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    what: str = "",
) -> T:
    """:func:`eventually` on an event loop: ``condition`` may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s} s: {what or _name(condition)}")
        await asyncio.sleep(POLL_S)


class Hold:
    """A fault point armed with ``hold`` (see :func:`holding`)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def reached(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Block until a thread is held at the point; fail if none got there in time."""
        if not faults.wait_reached(self.name, timeout_s):
            raise AssertionError(f"no thread reached fault point {self.name} in {timeout_s} s")

    async def reached_async(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """:meth:`reached` without blocking the event loop (the held thread may need it)."""
        await asyncio.to_thread(self.reached, timeout_s)

    def release(self) -> None:
        """Let every thread held at the point go on (and any that reaches it later)."""
        faults.release(self.name)


@contextmanager
def holding(name: str, times: int | None = None) -> Iterator[Hold]:
    """Arm ``name`` with ``hold`` for the block (``times``: only the first ``times`` threads
    to reach it are held); on leaving the block, held threads are released and the point is
    disarmed, even when the test failed."""
    faults.arm(name, "hold", times=times)
    hold = Hold(name)
    try:
        yield hold
    finally:
        hold.release()
        faults.disarm(name)


def _name(condition: Callable[..., object]) -> str:
    return getattr(condition, "__qualname__", repr(condition))
