"""rollsafe.children: what a process starts ends with it, even when it is SIGKILLed."""

import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest

from rollsafe.children import PARENT_PID_ENV

# A parent that starts one child the way rollsafe does, prints the child's pid, then waits to
# be killed. ``how`` picks the way: a rollsafe process watching its parent, or any binary bound
# to it by the kernel.
PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    from rollsafe.children import bound_to_parent, env_for_child
    how = sys.argv[1]
    if how == "watch":
        code = "import rollsafe.children as c, time; c.watch_parent(); time.sleep(120)"
        child = subprocess.Popen([sys.executable, "-c", code], env=env_for_child())
    else:
        child = subprocess.Popen(bound_to_parent(["sleep", "120"]))
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def wait_for_exit(pid: int, timeout_s: float) -> bool:
    """True once ``pid`` has ended (a pidfd: an event, not a poll), False at the timeout."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([pidfd], [], [], timeout_s)[0])
    finally:
        os.close(pidfd)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds and PR_SET_PDEATHSIG")
@pytest.mark.parametrize("how", ["watch", "bound"])
def test_a_child_ends_when_the_process_that_started_it_is_killed(how: str) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, how], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # alive while its parent is (ProcessLookupError if not)
        parent.send_signal(signal.SIGKILL)  # by pid: no cleanup runs in the parent
        parent.wait()
        assert wait_for_exit(child, 30), f"child {child} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_watched_child_does_not_hand_its_parent_pid_to_its_own_children(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollsafe.children import watch_parent

    monkeypatch.setenv(PARENT_PID_ENV, str(os.getpid()))  # "our parent" is ourselves: alive
    thread = watch_parent()
    assert thread is not None and thread.is_alive()
    assert PARENT_PID_ENV not in os.environ
    assert watch_parent() is None  # nothing left to watch
