"""Named fault points: ROLLSAFE_FAULT parsing, loud typos, programmatic arming."""

import errno
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollsafe import faults
from rollsafe.errors import InjectedFault, InvalidInput, TransientError
from rollsafe.faults import ENV_VAR, arm, disarm_all, fault_point
from rollsafe.testing.waiting import eventually


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(ENV_VAR, raising=False)
    disarm_all()
    yield
    disarm_all()


def test_an_unarmed_point_does_nothing() -> None:
    fault_point("phase.open.before")


def test_every_phase_has_a_before_and_an_after_point() -> None:
    assert {"phase.open.before", "phase.publish.after"} <= set(faults.known())
    assert len(faults.PHASE_POINTS) == 20


def test_env_var_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, " phase.open.after:raise , phase.capture.before:raise")
    fault_point("phase.open.before")  # not armed
    with pytest.raises(InjectedFault, match=r"phase\.open\.after") as caught:
        fault_point("phase.open.after")
    assert caught.value.transient and isinstance(caught.value, TransientError)
    with pytest.raises(InjectedFault):
        fault_point("phase.capture.before")


def test_env_var_is_read_at_every_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "phase.drain.before:raise")
    with pytest.raises(InjectedFault):
        fault_point("phase.drain.before")
    monkeypatch.setenv(ENV_VAR, "")
    fault_point("phase.drain.before")


def test_exit_is_the_default_action(tmp_path: Path) -> None:
    env = {**os.environ, ENV_VAR: "phase.open.before"}
    code = (
        "from rollsafe.faults import fault_point; fault_point('phase.open.before'); print('alive')"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == faults.EXIT_CODE == 137
    assert "alive" not in done.stdout


def test_a_typo_in_the_env_var_fails_loudly_listing_known_points(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_VAR, "phase.opne.before:raise")
    with pytest.raises(InvalidInput, match=r"unknown fault point\(s\) phase.opne.before") as caught:
        fault_point("phase.drain.before")  # any check, not only the misspelt one
    assert "phase.open.before" in str(caught.value)


def test_an_unknown_action_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "phase.open.before:explode")
    with pytest.raises(InvalidInput, match="explode"):
        fault_point("phase.open.before")


def test_a_point_must_be_registered() -> None:
    with pytest.raises(InvalidInput, match="never registered"):
        fault_point("phase.nowhere.before")
    (name,) = faults.register("test.faults.custom")
    fault_point(name)


def test_arm_and_disarm() -> None:
    arm("phase.resume.after", "raise")
    with pytest.raises(InjectedFault):
        fault_point("phase.resume.after")
    disarm_all()
    fault_point("phase.resume.after")
    with pytest.raises(InvalidInput, match="unknown fault point"):
        arm("phase.resme.after", "raise")
    with pytest.raises(InvalidInput, match="action"):
        arm("phase.resume.after", "boom")


def test_arm_a_limited_number_of_times() -> None:
    arm("phase.drain.before", "raise", times=2)
    for _ in range(2):
        with pytest.raises(InjectedFault):
            fault_point("phase.drain.before")
    fault_point("phase.drain.before")  # cleared, as a transient fault would
    with pytest.raises(InvalidInput, match="times"):
        arm("phase.drain.before", "raise", times=0)


def test_sleep_slows_a_point_down(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "phase.drain.before:sleep:0.05")
    started = time.monotonic()
    fault_point("phase.drain.before")
    assert time.monotonic() - started >= 0.05
    for bad in ("sleep", "sleep:-1", "sleep:soon", "raise:2", "oserror", "oserror:ENOTANERRNO"):
        with pytest.raises(InvalidInput, match="expected exit, raise, invariant, oserror"):
            arm("phase.drain.before", bad)


def test_oserror_raises_what_the_system_would() -> None:
    faults.arm("phase.open.before", "oserror:ENOSPC", times=1)
    with pytest.raises(OSError, match="No space left on device") as raised:
        fault_point("phase.open.before")
    assert raised.value.errno == errno.ENOSPC and "phase.open.before" in str(raised.value)
    fault_point("phase.open.before")  # fired once


def test_invariant_action_raises_an_error_that_is_not_retried() -> None:
    from rollsafe.errors import InjectedInvariantFault, InvariantError

    faults.arm("phase.open.before", "invariant", times=1)
    with pytest.raises(InjectedInvariantFault, match=r"phase\.open\.before") as caught:
        fault_point("phase.open.before")
    assert isinstance(caught.value, InvariantError) and not caught.value.transient
    fault_point("phase.open.before")  # fired once, then disarmed


def test_hold_blocks_until_released_and_says_when_reached() -> None:
    import threading

    arm("phase.open.before", "hold")
    passed = threading.Event()

    def caller() -> None:
        fault_point("phase.open.before")
        passed.set()

    thread = threading.Thread(target=caller)
    thread.start()
    assert faults.wait_reached("phase.open.before", 5)
    assert not passed.is_set()  # held there
    faults.release("phase.open.before")
    assert passed.wait(5)
    thread.join(5)
    fault_point("phase.open.before")  # released for good: a later caller goes through


def test_disarm_all_lets_held_threads_go() -> None:
    import threading

    arm("phase.open.before", "hold")
    thread = threading.Thread(target=fault_point, args=("phase.open.before",))
    thread.start()
    assert faults.wait_reached("phase.open.before", 5)
    disarm_all()
    thread.join(5)
    assert not thread.is_alive()


def test_hold_is_for_in_process_tests_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "phase.open.before:hold")
    with pytest.raises(InvalidInput, match="in-process tests"):
        fault_point("phase.open.before")
    with pytest.raises(InvalidInput, match="not armed with hold"):
        faults.release("phase.capture.before")


def test_until_holds_another_process_at_the_point_until_its_release_file_exists(
    tmp_path: Path,
) -> None:
    """The hold across processes: the child says it got there (``<path>.reached``) and waits
    until this process creates ``<path>``; then it goes on, and so does every later pass."""
    release = tmp_path / "release"
    env = {**os.environ, ENV_VAR: f"phase.capture.before:until:{release}"}
    code = (
        "from rollsafe.faults import fault_point\n"
        "fault_point('phase.capture.before'); print('through', flush=True)\n"
        "fault_point('phase.capture.before'); print('again', flush=True)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        reached = tmp_path / f"release{faults.REACHED_SUFFIX}"
        eventually(reached.exists, what="the child held at the point")
        assert child.poll() is None  # held: nothing printed, still running
        release.touch()
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
        child.wait()
    assert out.split() == ["through", "again"] and child.returncode == 0


def test_until_needs_an_absolute_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "phase.open.before:until:relative/file")
    with pytest.raises(InvalidInput, match="until:<path>"):
        fault_point("phase.open.before")
