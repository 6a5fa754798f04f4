"""The conformance suite (``rollsafe.env.conformance``, ``rollsafe env-check``) against real
processes: one ``rollsafe engine serve`` and three ``rollsafe env serve workplace`` instances
(lease grace 1 s), every check passing on each; an instance whose status lies about its
checkpoint id (a fault switch) fails the checks that read it; the CLI exits 0 on a conformant
instance and 2 when the instance refuses the token (a wrong argument: nothing can be checked)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator

import httpx
import pytest

from rollsafe.env.conformance import CHECKS, ConformanceReport, run_conformance
from rollsafe.served import ENGINE_BANNER, ENV_BANNER, ServedProcess, rollsafe_command

ENGINE_TOKEN = "conf-engine-token"
ENV_TOKEN = "conf-env-token"
TASK = {"seed": 3, "meetings": 3, "turns": 16}
INSTANCES = ("conf-a", "conf-b", "conf-c")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServedProcess]]:
    """The engine and three workplace instances; every process stopped by its pid at the end,
    also when one of them never came up."""
    logs = tmp_path_factory.mktemp("conformance")
    started: list[ServedProcess] = []
    try:
        engine = ServedProcess(
            rollsafe_command(
                "engine", "serve", "--port", "0", "--token", ENGINE_TOKEN, "--seed", "1"
            ),
            logs / "engine",
        )
        started.append(engine)
        engine.wait_listening(ENGINE_BANNER.format(kind="dense"))
        envs: dict[str, ServedProcess] = {}
        for name in INSTANCES:
            args = ["env", "serve", "workplace", "--port", "0", "--token", ENV_TOKEN]
            args += ["--engine-url", engine.url, "--engine-token", ENGINE_TOKEN]
            args += ["--instance", name, "--lease-grace-s", "1"]
            envs[name] = ServedProcess(rollsafe_command(*args), logs / name)
            started.append(envs[name])
        for name, server in envs.items():  # started together, awaited in turn
            server.wait_listening(ENV_BANNER.format(name="workplace", instance=name))
        yield envs
    finally:
        for server in reversed(started):
            server.stop()


def failures(report: ConformanceReport) -> str:
    return "\n".join(
        f"{report.instance} {c.name}: {c.detail}" for c in report.checks if not c.passed
    )


async def test_every_check_passes_on_three_instances(servers: dict[str, ServedProcess]) -> None:
    lines: list[str] = []
    reports = await asyncio.gather(
        *(
            run_conformance(s.url, ENV_TOKEN, task=TASK, lease_wait_s=5, progress=lines.append)
            for s in servers.values()
        )
    )
    for name, report in zip(servers, reports, strict=True):
        assert report.passed, failures(report)
        assert report.instance == name
        assert [c.name for c in report.checks] == [fn.__name__ for fn in CHECKS]
        assert not any(c.skipped for c in report.checks), report.checks
        # The parked episodes' records were found on this disk and verified.
        (commit,) = (c for c in report.checks if c.name == "prepare_commit_resume")
        assert "verified on disk" in commit.detail and "committed 0" not in commit.detail
    assert len(lines) == len(CHECKS) * len(INSTANCES)


async def test_a_lying_status_fails_the_checks_that_read_it(
    servers: dict[str, ServedProcess],
) -> None:
    url, auth = servers[INSTANCES[2]].url, {"authorization": f"Bearer {ENV_TOKEN}"}
    async with httpx.AsyncClient(base_url=url, headers=auth) as http:
        assert (await http.post("/faults", json={"stale_checkpoint": True})).status_code == 200
        try:
            report = await run_conformance(url, ENV_TOKEN, task=TASK, lease_wait_s=0)
        finally:
            assert (await http.post("/faults", json={})).status_code == 200
    failed = {c.name: c.detail for c in report.checks if not c.passed}
    assert not report.passed
    assert set(failed) == {"status_shape", "prepare_commit_resume", "wrong_phase", "restore"}
    assert failed["status_shape"].startswith("not idle"), failed
    # Every check still left the instance idle: the real status (no fault) says so.
    assert (await run_conformance(url, ENV_TOKEN, lease_wait_s=0)).passed


def test_env_check_exits_0_on_a_conformant_instance(servers: dict[str, ServedProcess]) -> None:
    url, task = servers[INSTANCES[0]].url, {"seed": 1, "turns": 6}
    command = rollsafe_command("env-check", url, "--token", ENV_TOKEN, "--task", json.dumps(task))
    done = subprocess.run(
        [*command, "--lease-wait-s", "5"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for fn in CHECKS:
        assert f"PASS {fn.__name__} (" in done.stdout, done.stdout
    assert "all checks passed" in done.stdout


def test_env_check_with_a_wrong_token_exits_2_naming_it(servers: dict[str, ServedProcess]) -> None:
    url = servers[INSTANCES[1]].url
    env = {**os.environ, "ROLLSAFE_ENV_TOKEN": "not-the-token"}  # the token from the variable
    done = subprocess.run(
        rollsafe_command("env-check", url, "--json"),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "refused the token (401)" in done.stderr and done.stdout == ""
