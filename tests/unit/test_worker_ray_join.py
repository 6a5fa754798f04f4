"""``rollsafe worker`` when Ray does not let it join: one line naming the address, Ray's cause
(never the traceback a Ray Client error carries from the server) and the fix for that kind of
address (a Ray Client ``ray://`` address: the head's Ray Client port, matching versions).

The texts are Ray 2.60's own: the Ray Client ``Initialization failure`` was captured from a
worker joining a head of another Python (3.12) through Ray Client; the version mismatch is made
by Ray's own check. A real ``ray.init`` against a port that is not Ray (Ray's retries
cut to 1 s each): tests/integration/test_worker_ray_client.py."""

from __future__ import annotations

import platform
from typing import Any

import pytest
from typer.testing import CliRunner

from rollsafe.cli import app as cli_app
from rollsafe.cli.app import app
from rollsafe.cli.doctor.checks import check_ray, ray_client_fix, ray_error_cause

RUN = "ray-join"
INIT_FAILURE = (
    "Initialization failure from server:\n"
    "Traceback (most recent call last):\n"
    '  File "/work/main/.venv-gym/lib/python3.12/site-packages/ray/util/client/server/'
    'proxier.py", line 772, in Datapath\n'
    "    raise RuntimeError(\n"
    "RuntimeError: Starting Ray client server failed\n"
)
NO_CLUSTER = (
    "Could not find any running Ray instance. Please specify the one to connect to by setting "
    "`--address` flag or `RAY_ADDRESS` environment variable."
)


def version_mismatch() -> str:
    """Ray's own text for a head of another Python, as Ray Client raises it."""
    from ray._private.utils import check_version_info

    with pytest.raises(RuntimeError) as caught:
        check_version_info(
            {"ray_version": "2.60.0", "python_version": "2.7.18"},
            "Ray Client",
            python_version_match_level="minor",
        )
    return str(caught.value)


def one_line_error(result: Any) -> str:
    assert "Traceback" not in result.output, result.output
    lines: list[str] = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def worker(address: str) -> Any:
    env = {"RAY_ADDRESS": None}
    return CliRunner().invoke(app, ["worker", "--run", RUN, "--ray-address", address], env=env)


@pytest.fixture
def ray_refuses(monkeypatch: pytest.MonkeyPatch) -> list[BaseException]:
    """The pre-check passes and ray.init raises the error the test puts in the list."""
    raised: list[BaseException] = []

    async def run_worker(*args: object, **kwargs: object) -> None:
        raise raised[0]

    monkeypatch.setattr(cli_app, "_ray_problem", lambda address: None)
    monkeypatch.setattr(cli_app, "_ray_joined", lambda: False)
    monkeypatch.setattr("rollsafe.workers.checkpoint.run_worker", run_worker)
    return raised


def test_a_traceback_from_the_server_is_reduced_to_its_last_line() -> None:
    assert ray_error_cause(INIT_FAILURE) == (
        "Initialization failure from server: RuntimeError: Starting Ray client server failed"
    )


def test_a_version_mismatch_is_one_line_with_both_versions() -> None:
    text = version_mismatch()
    assert "\n" in text  # Ray's own spans six lines
    assert ray_error_cause(text) == (
        "Version mismatch: The cluster was started with: Ray: 2.60.0 Python: 2.7.18 This "
        f"process on Ray Client was started with: Ray: {_ray_version()} Python: "
        f"{platform.python_version()}"
    )


def test_rays_advice_about_its_own_address_flag_is_dropped() -> None:
    assert ray_error_cause(NO_CLUSTER) == "Could not find any running Ray instance"
    assert ray_error_cause("ray client connection timeout") == "ray client connection timeout"


def test_a_ray_client_init_failure_is_one_line_with_the_ray_client_fix(
    ray_refuses: list[BaseException],
) -> None:
    ray_refuses.append(ConnectionAbortedError(INIT_FAILURE))  # a ConnectionError, as Ray's
    result = worker("ray://head.example:10001")
    assert result.exit_code == 1
    line = one_line_error(result)
    assert line == (
        "error: cannot join Ray at ray://head.example:10001: Initialization failure from "
        "server: RuntimeError: Starting Ray client server failed "
        f"(fix: {ray_client_fix('head.example', 10001)})"
    )
    fix = ray_client_fix("head.example", 10001)
    assert "--ray-client-server-port=10001" in fix
    assert f"Python {platform.python_version()}, Ray {_ray_version()}" in fix
    assert "`ray start --head`)" not in line  # not the GCS fix


def test_a_version_mismatch_through_ray_client_is_one_line(
    ray_refuses: list[BaseException],
) -> None:
    ray_refuses.append(RuntimeError(version_mismatch()))
    line = one_line_error(worker("ray://10.0.0.7:10001"))
    assert "cannot join Ray at ray://10.0.0.7:10001: Version mismatch:" in line
    assert "Python: 2.7.18" in line and "Ray Client needs both to match" in line


def test_a_gcs_address_keeps_the_start_ray_fix(ray_refuses: list[BaseException]) -> None:
    ray_refuses.append(ConnectionError(NO_CLUSTER))
    line = one_line_error(worker("10.0.0.1:6379"))
    assert line.startswith(
        "error: cannot join Ray at 10.0.0.1:6379: Could not find any running Ray instance (fix: "
        "start Ray (`ray start --head`)"
    )
    assert "Ray Client" not in line


def test_a_ray_client_port_where_nothing_listens_gets_the_ray_client_fix(dead_port: int) -> None:
    result = worker(f"ray://127.0.0.1:{dead_port}")
    assert result.exit_code == 1
    line = one_line_error(result)
    assert line == (
        f"error: cannot join Ray: cannot reach Ray Client at 127.0.0.1:{dead_port}: "
        f"Connection refused (fix: {ray_client_fix('127.0.0.1', dead_port)})"
    )
    # The doctor's row says the same.
    check = check_ray(f"ray://127.0.0.1:{dead_port}", 1.0)
    assert check.fix == ray_client_fix("127.0.0.1", dead_port)
    gcs = check_ray(f"127.0.0.1:{dead_port}", 1.0)
    assert "Ray Client" not in gcs.fix and "host:6379" in gcs.fix


def _ray_version() -> str:
    from importlib.metadata import version

    return version("ray")
