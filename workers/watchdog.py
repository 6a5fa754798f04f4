"""A worker that is stuck is taken out: its probes say so, then it exits for its supervisor to
restart it (issue 35: a worker frozen inside a snapshot came back unable to serve, and its
probes hung without answering).

Two things are watched, each by a :class:`Watch` that something beats while it works:

- the worker's event loop (a task beats every ``BEAT_S``): the workflows, the activities'
  heartbeats and the pollers all run on it;
- its channel to Ray (a thread looks the run's controller actor up in the GCS every
  ``BEAT_S``): every phase calls the controller through it.

A watchdog thread checks both every ``CHECK_S``. Time counts as stuck only while the watchdog
itself runs: a process that was stopped (SIGSTOP, a suspended VM) is not stuck for the time it
was stopped. The probes answer from a thread of their own (docs/deploy.md, "Health"):
``stuck`` (503 on both) once one watch is stuck for ``STUCK_AFTER_S``; past ``exit_after_s``
the watchdog logs the stuck thread's stack and exits the process with ``STUCK_EXIT``. A
process continued after a stop of ``STOPPED_EXIT_S`` or more exits the same way at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from rollsafe.faults import fault_point, register

BEAT_S = 0.5
CHECK_S = 1.0
STUCK_AFTER_S = 5.0
EXIT_AFTER_S = 60.0  # the default of `rollsafe worker --stuck-exit`
# A worker continued after being stopped this long exits at once: the server timed its
# workflow tasks out meanwhile (PhaseOptions.task_timeout_s, 10 s) and went on handing it
# the next attempts through the polls it had left open; what it finds on waking is stale,
# and working through it held a snapshot for minutes (issue 35). A new process starts clean.
STOPPED_EXIT_S = 10.0
STUCK_EXIT = 70  # EX_SOFTWARE: the supervisor restarts the worker
# Hold one (``until:<path>``): the event loop, or the channel to Ray, is stuck.
LOOP_BEAT, RAY_BEAT = register("worker.loop.beat", "worker.ray.beat")
log = logging.getLogger(__name__)


class Watch:
    """How long something beating (``beat``) has not, as the watchdog (``check``) saw it."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.clock = clock
        self.beats = 0
        self.stuck_s = 0.0
        self.thread_id: int | None = None  # whose stack to log when it is stuck
        self._seen = 0
        self._checked = clock()

    def beat(self) -> None:
        self.beats += 1
        self.thread_id = threading.get_ident()

    def check(self) -> float:
        """Seconds stuck so far; a check long after the last (the process was stopped)
        counts one interval, not the gap."""
        now = self.clock()
        elapsed, self._checked = now - self._checked, now
        if self.beats != self._seen:
            self._seen, self.stuck_s = self.beats, 0.0
        else:
            self.stuck_s += min(elapsed, 2 * CHECK_S)
        return self.stuck_s

    def describe(self) -> str:
        return f"the worker's {self.name} has not moved for {self.stuck_s:.0f} s"


async def beat_loop(watch: Watch) -> None:
    """On the event loop, for as long as it runs."""
    import asyncio

    while True:
        fault_point(LOOP_BEAT)
        watch.beat()
        await asyncio.sleep(BEAT_S)


def beat_ray(watch: Watch, look_up: Callable[[], object], stop: threading.Event) -> None:
    """On a thread of its own: each GCS answer (an actor found or not) is a beat."""
    while not stop.is_set():
        fault_point(RAY_BEAT)
        with contextlib.suppress(ValueError):  # no such actor (yet): the GCS answered
            look_up()
        watch.beat()
        stop.wait(BEAT_S)


def stuck(watches: Sequence[Watch]) -> Watch | None:
    """The watch stuck longest past STUCK_AFTER_S, if any."""
    worst = max(watches, key=lambda watch: watch.stuck_s, default=None)
    return worst if worst is not None and worst.stuck_s >= STUCK_AFTER_S else None


def watchdog(
    watches: Sequence[Watch],
    exit_after_s: float,
    stop: threading.Event,
    exit: Callable[[int], object] = os._exit,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Every CHECK_S: check each watch; exit the process once one is stuck past
    ``exit_after_s``, after logging where it is stuck, or at once when the process was
    stopped for ``min(exit_after_s, STOPPED_EXIT_S)`` or longer."""
    stopped_exit_s = min(exit_after_s, STOPPED_EXIT_S)
    checked = clock()
    while not stop.wait(CHECK_S):
        now = clock()
        stopped_s, checked = now - checked - CHECK_S, now
        for watch in watches:
            watch.check()
        if stopped_s >= stopped_exit_s:
            _exit(
                f"the worker was stopped for {stopped_s:.0f} s (SIGSTOP, a suspended machine): "
                "the workflow tasks and polls it held went stale meanwhile",
                None,
                exit,
            )
            return
        worst = stuck(watches)
        if worst is not None and worst.stuck_s >= exit_after_s:
            _exit(worst.describe(), worst.thread_id, exit)
            return


def _exit(why: str, thread_id: int | None, exit: Callable[[int], object]) -> None:
    where = f"; where it is stuck:\n{_stack(thread_id)}" if thread_id is not None else ""
    log.error(
        "%s: exiting (%d) for the worker's supervisor to start a new one%s",
        why,
        STUCK_EXIT,
        where,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    exit(STUCK_EXIT)


def _stack(thread_id: int | None) -> str:
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    return "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
