"""Child processes that do not outlive the process that started them.

A process killed from outside (a timeout's SIGKILL, an OOM kill) runs no cleanup, so the
servers it started would run on, holding ports, files and CPU. Two ways, by what the child is:

- **A rollsafe process** (``rollsafe engine serve``, ``env serve``, ``worker``, ...): the
  starter passes its pid in :data:`PARENT_PID_ENV` (:func:`env_for_child`); the child's
  :func:`watch_parent` waits on that pid (a pidfd on Linux, else a poll) and, when it ends,
  sends itself SIGTERM (the same graceful stop as ``stop()``), then exits after
  :data:`EXIT_GRACE_S` if that did not end it.
- **Any other binary** (the Temporal dev server): :func:`bound_to_parent` wraps its command in
  ``python -m rollsafe.children``, which asks the kernel to SIGKILL it when its parent ends
  (Linux ``PR_SET_PDEATHSIG``) and then execs it, under the same pid. The kernel ties that to
  the *thread* that started the child: start such a child from a thread that lives as long as
  the child (the main thread, in every caller here). Elsewhere than Linux the command runs as
  is.

Either way nothing is signalled by name: a child acts on its own death notice.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence

PARENT_PID_ENV = "ROLLSAFE_PARENT_PID"
EXIT_GRACE_S = 30.0  # after the SIGTERM: a worker may be finishing an activity
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def env_for_child(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, ``env`` over it, and its pid for the child to watch."""
    return {**os.environ, **(env or {}), PARENT_PID_ENV: str(os.getpid())}


def watch_parent() -> threading.Thread | None:
    """When :data:`PARENT_PID_ENV` names this process's parent, end this process once that
    parent ends (see the module doc); None when there is nothing to watch. The variable is
    removed first: this process's own children are told its pid, not inherit its parent's."""
    value = os.environ.pop(PARENT_PID_ENV, None)
    if value is None:
        return None
    parent = int(value)  # not os.getppid(): a launcher in between (a shell) is not the owner
    thread = threading.Thread(
        target=_end_with, args=(parent,), name="rollsafe-parent-watch", daemon=True
    )
    thread.start()
    return thread


def bound_to_parent(command: Sequence[str]) -> list[str]:
    """``command`` run so that the kernel kills it when the calling thread's process ends
    (module doc); unchanged where the kernel cannot (not Linux)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-m", "rollsafe.children", str(os.getpid()), "--", *command]


def _end_with(parent: int) -> None:
    _wait_for_exit(parent)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(EXIT_GRACE_S)
    os._exit(1)  # the graceful stop did not end us: nothing is left to stop for


def _wait_for_exit(pid: int) -> None:
    """Return once ``pid`` has ended (at once if it already has)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfds (not Linux >= 5.3): poll
        while _alive(pid):
            time.sleep(0.5)
        return
    try:
        select.select([pidfd], [], [])  # readable once the process has ended
    finally:
        os.close(pidfd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the pid exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exec_bound(argv: Sequence[str]) -> None:
    """``PARENT -- COMMAND...``: die with PARENT, then become COMMAND."""
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m rollsafe.children PARENT_PID -- COMMAND [ARGS...]")
    parent, command = int(argv[0]), list(argv[2:])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it ended before the line above: no signal will come
        raise SystemExit(f"parent {parent} has already exited")
    os.execvp(command[0], command)


if __name__ == "__main__":
    _exec_bound(sys.argv[1:])
