"""Named fault points (docs/design.md section 12): places where a test can crash the process, or
raise, exactly between "done" and "recorded".

Arm points with the environment variable ``ROLLSAFE_FAULT`` (read at every check, so a
subprocess or a Ray actor started with it is armed), a comma-separated list of ``name`` or
``name:action``, where action is ``exit`` (``os._exit(137)``, as a kill -9 would look; the
default), ``raise`` (:class:`InjectedFault`, a transient error), ``invariant``
(:class:`InjectedInvariantFault`, one that must not be retried), ``oserror:<ERRNO>`` (the
``OSError`` the operating system would raise there, e.g. ``oserror:ENOSPC`` for a full disk),
``sleep:<seconds>`` (a slow step) or ``until:<path>`` (another process's hold: the thread that
reaches the point creates ``<path>.reached`` and waits there until ``<path>`` exists; once it
does, the point lets every thread through). In-process tests use :func:`arm` (optionally firing
only ``times`` times) and :func:`disarm_all` instead, and may arm ``hold``: the point blocks
the thread that reaches it until the test calls :func:`release` (:func:`wait_reached` tells
when one got there), so a test can catch a call mid-flight without sleeping.

Every point is declared with :func:`register` when its module is imported, so an armed name
that no code declares (a typo) fails loudly at the first check, listing the known names,
instead of silently never firing.
"""

from __future__ import annotations

import errno
import math
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rollsafe.core.phases import PHASES
from rollsafe.errors import (
    InjectedFault,
    InjectedInvariantFault,
    InvalidInput,
)

ENV_VAR = "ROLLSAFE_FAULT"
EXIT_CODE = 137
_ACTIONS = "exit, raise, invariant, oserror:<ERRNO>, sleep:<seconds> or until:<path>"
UNTIL_POLL_S = 0.01  # how often a point held by until:<path> looks for its release file
REACHED_SUFFIX = ".reached"


@dataclass
class _Armed:
    kind: str  # exit | raise | invariant | oserror | sleep | hold | until
    seconds: float = 0.0
    code: int = 0  # oserror: the errno
    path: str = ""  # until: the release file
    left: int | None = None  # fires this many more times; None: until disarmed
    reached: threading.Event = field(default_factory=threading.Event)  # hold: one got there
    released: threading.Event = field(default_factory=threading.Event)  # hold: let them go


_lock = threading.Lock()
_known: set[str] = set()
_armed: dict[str, _Armed] = {}
_holds: dict[str, _Armed] = {}  # armed with hold, kept after they fire: release finds them
_parsed: tuple[str, dict[str, _Armed]] = ("", {})  # the last ROLLSAFE_FAULT value seen


def register(*names: str) -> tuple[str, ...]:
    """Declare fault points; returns them, so a module can keep them as constants."""
    with _lock:
        _known.update(names)
    return names


def known() -> list[str]:
    with _lock:
        return sorted(_known)


def arm(name: str, action: str, times: int | None = None) -> None:
    """Arm ``name`` in this process; ``times`` limits how often it fires (a fault that
    clears after N attempts, as a transient one would)."""
    _check_known([name])
    if times is not None and (type(times) is not int or times < 1):
        raise InvalidInput(f"times must be an integer >= 1, got {times!r}")
    armed = _Armed("hold") if action == "hold" else _parse_action(action, "")
    armed.left = times
    with _lock:
        _armed[name] = armed
        _holds[name] = armed


def wait_reached(name: str, timeout: float) -> bool:
    """Whether a thread reached the held point ``name`` within ``timeout`` seconds."""
    with _lock:
        held = _holds.get(name)
    if held is None or held.kind != "hold":
        raise InvalidInput(f"fault point {name!r} is not armed with hold")
    return held.reached.wait(timeout)


def release(name: str) -> None:
    """Let every thread held at ``name`` go on (and any that reaches it later)."""
    with _lock:
        held = _holds.get(name)
    if held is None or held.kind != "hold":
        raise InvalidInput(f"fault point {name!r} is not armed with hold")
    held.released.set()


def disarm(name: str) -> None:
    """Disarm ``name``; threads held at it are let go."""
    with _lock:
        _armed.pop(name, None)
        held = _holds.pop(name, None)
    if held is not None:
        held.released.set()


def disarm_all() -> None:
    """Disarm every point; threads held at a point are let go."""
    with _lock:
        _armed.clear()
        holds = list(_holds.values())
        _holds.clear()
    for held in holds:
        held.released.set()


def fault_point(name: str) -> None:  # noqa: C901 (one branch per fault action)
    """Fire if ``name`` is armed here or in ``ROLLSAFE_FAULT``; otherwise do nothing."""
    if name not in _known:
        raise InvalidInput(f"fault point {name!r} was never registered")
    with _lock:
        armed = _armed.get(name)
        if armed is not None and armed.left is not None:
            armed.left -= 1
            if armed.left == 0:
                del _armed[name]
    armed = armed or _from_env().get(name)
    if armed is None:
        return
    if armed.kind == "exit":
        os._exit(EXIT_CODE)
    if armed.kind == "raise":
        raise InjectedFault(name)
    if armed.kind == "invariant":
        raise InjectedInvariantFault(name)
    if armed.kind == "oserror":
        raise OSError(armed.code, os.strerror(armed.code), f"<fault point {name}>")
    if armed.kind == "hold":
        armed.reached.set()
        armed.released.wait()
        return
    if armed.kind == "until":
        _wait_for_file(armed.path)
        return
    time.sleep(armed.seconds)  # a phase that takes long: heartbeats, timeouts, aborts


def _wait_for_file(path: str) -> None:
    """until:<path>: say so (``<path>.reached``), then wait for the releasing process to create
    ``<path>`` (a file another process writes is all two processes share here)."""
    release = Path(path)
    if release.exists():
        return
    Path(path + REACHED_SUFFIX).touch()
    while not release.exists():
        time.sleep(UNTIL_POLL_S)


def _parse_action(action: str, where: str) -> _Armed:
    kind, _, arg = action.partition(":")
    if kind == "hold":
        raise InvalidInput(
            f"{where}fault action 'hold' is for in-process tests (rollsafe.faults.arm): "
            "no other process could release it"
        )
    if kind in ("exit", "raise", "invariant") and not arg:
        return _Armed(kind)
    if kind == "oserror" and isinstance(number := getattr(errno, arg, None), int):
        return _Armed(kind, code=number)
    if kind == "until" and Path(arg).is_absolute():
        return _Armed(kind, path=arg)
    if kind == "sleep":
        try:
            seconds = float(arg)
        except ValueError:
            seconds = -1.0
        if 0 <= seconds < math.inf:
            return _Armed(kind, seconds)
    raise InvalidInput(f"{where}fault action {action!r}: expected {_ACTIONS}")


def _from_env() -> dict[str, _Armed]:
    global _parsed
    raw = os.environ.get(ENV_VAR, "")
    if raw == _parsed[0]:
        return _parsed[1]
    points: dict[str, _Armed] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, _, action = item.partition(":")
        points[name] = _parse_action(action or "exit", f"{ENV_VAR}={raw!r}: {name}: ")
    _check_known(points, f"{ENV_VAR}={raw!r}: ")
    _parsed = (raw, points)
    return points


def _check_known(names: Iterable[str], prefix: str = "") -> None:
    unknown = sorted(set(names) - _known)
    if unknown:
        raise InvalidInput(
            f"{prefix}unknown fault point(s) {', '.join(unknown)}; known: {', '.join(known())}"
        )


# Every phase of a rollout snapshot, around the point where its side effect is recorded.
PHASE_POINTS = register(
    *(f"phase.{phase.value}.{when}" for phase in PHASES for when in ("before", "after"))
)
