"""``rollsafe worker --ray-address ray://HOST:PORT`` where PORT accepts TCP but is no Ray Client
server: the pre-check's TCP connect passes, the real ``ray.init`` fails after Ray's own retries
(three, each cut to 1 s by Ray Client's own timeout variables: 35 s by default), and the worker
exits 1 with one error line naming the address, Ray's cause and the Ray Client fix, with neither
a traceback nor Ray's two-line warning. A process of its own: this session's Ray may already be
joined, and a joined worker never calls ``ray.init``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollsafe.cli.doctor.checks import ray_client_fix

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


def test_a_port_that_is_not_ray_client_is_one_line_with_its_fix(
    silent_port: int,
) -> None:
    address = f"ray://127.0.0.1:{silent_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TEMPORAL_", "RAY_"))}
    env.update(
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="disabled",
        RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S="1",
        RAY_CLIENT_MAX_CONNECTION_TIMEOUT_S="1",
    )
    done = subprocess.run(
        [sys.executable, "-m", "rollsafe", "worker", "--run", "notray", "--ray-address", address],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "warnings.warn" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: cannot join Ray at {address}: ray client connection timeout "
        f"(fix: {ray_client_fix('127.0.0.1', silent_port)})"
    ], done.stderr
