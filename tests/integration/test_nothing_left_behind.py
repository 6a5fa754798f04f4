"""A demo SIGKILLed mid-run leaves no process behind: the Temporal dev server, Ray's processes,
the engine and environment servers and the checkpoint worker all end with it
(rollsafe.children; Ray's own processes share their starter's fate by themselves).

Found before: two ``temporal server start-dev`` processes outlived demos killed by a timeout,
for 35 minutes."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and pidfds"),
]

SURVIVAL_S = 90.0  # a worker's graceful stop (rollsafe.children.EXIT_GRACE_S) and Ray's


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid``; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, str]:
    """Every living process below ``root``: pid -> its command line."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = stat[0]
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = _cmdline(pid)
                frontier.append(pid)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
    except OSError:
        return "?"


def test_a_demo_killed_mid_run_leaves_no_process_of_it_behind(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "rollsafe", "demo", "--no-faults", "--steps", "3"]
    demo = subprocess.Popen(
        [*command, "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pidfds: dict[int, int] = {}
    try:
        assert demo.stdout is not None
        for line in demo.stdout:  # mid-run: every server up, a snapshot published
            if line.startswith("[snapshot]"):
                break
        else:
            pytest.fail(f"the demo ended before its first snapshot (exit {demo.wait()})")
        tree = descendants(demo.pid)
        commands = " ".join(tree.values())
        for part in ("temporal", "raylet", "engine serve", "env serve", "worker --run"):
            assert part in commands, f"no {part!r} process under the demo: {tree}"
        # Opened before the kill: each pidfd is that very process, whatever reuses its pid.
        pidfds = {pid: os.pidfd_open(pid) for pid in tree if _stat(pid) is not None}
        demo.send_signal(signal.SIGKILL)  # no cleanup runs in the demo
        demo.wait()
        left, deadline = dict(pidfds), time.monotonic() + SURVIVAL_S
        while left and (remaining := deadline - time.monotonic()) > 0:
            ended, _, _ = select.select(list(left.values()), [], [], remaining)
            left = {pid: fd for pid, fd in left.items() if fd not in ended}
        assert not left, "outlived the demo: " + "; ".join(f"{p} {tree[p]}" for p in left)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for fd in pidfds.values():  # ours (below the demo we started): end what is left
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
