"""NeMo Gym's real servers, unmodified, 0.7.0 and 0.4.0, each in its own venv (``make setup``
builds ``.venv-gym`` and ``.venv-gym-0.4``), started and stopped by
:class:`rollsafe.gym.servers.GymServers`; on 0.7 with the legacy_agent environment server in
front of simple_agent, as NeMo RL runs it.

What rollsafe's exactly-once layer must guard against, seen on the real workplace_assistant
server: a session lives in the server's memory under a signed session cookie; the same
``calendar_create_event`` sent twice creates two events (two ids); a tool call without a seeded
session is an HTTP 400. ``/verify`` scores a transcript alone. simple_agent runs an episode
through the model address of its config (a scripted model here) and the real tools. The config
:func:`rollsafe.gym.servers.gym_config` builds is one nemo_gym's own validation accepts, with the
tool proxy in between or without, and on 0.7 with the environment server. ``crash()``
SIGKILLs every server by pid; a server that cannot start fails ``start()``, and the others are
stopped; a starter killed from outside leaves no server behind.

Never skipped: ``make test`` builds the gym venvs first, and a missing one fails the test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollsafe.errors import InvalidInput, ServerDidNotStart
from rollsafe.gym.servers import (
    AGENT_SECTION,
    ENVIRONMENT_SECTION,
    MODEL_SECTION,
    RESOURCES_SECTION,
    TOOL_PROXY_SECTION,
    WORKPLACE,
    GymPorts,
    GymServers,
    gym_config,
    gym_python,
    gym_version,
)
from rollsafe.testing.gym import GYM_RELEASES, gym_release_venv
from rollsafe.testing.waiting import eventually

SESSION_COOKIE = "WorkbenchResourcesServer___workplace_assistant"  # class name ___ section
EVENT = {
    "event_name": "rollsafe sentinel",
    "participant_email": "carlos@atlas.com",
    "event_start": "2023-12-01 10:00:00",
    "duration": "30",
}


def _venv(release: str) -> Path:
    try:
        return gym_release_venv(release)
    except InvalidInput as missing:  # `make test` builds it first: never a skip
        pytest.fail(f"NeMo Gym's venv is missing: {missing}")


@pytest.fixture(scope="module", params=GYM_RELEASES)
def venv(request: pytest.FixtureRequest) -> Path:
    """Each test once per NeMo Gym release, in that release's venv."""
    return _venv(request.param)


@pytest.fixture(scope="module")
def default_venv() -> Path:
    return _venv(GYM_RELEASES[0])


def _example_row(venv: Path) -> dict[str, Any]:
    """The first task of workplace_assistant's own example data (email: reply to carlos)."""
    return WORKPLACE.example_rows(gym_python(venv))[0]


def _response(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A minimal Responses API response (what ``/verify`` and simple_agent read)."""
    return {
        "id": "resp-rollsafe",
        "created_at": 0,
        "model": "scripted",
        "object": "response",
        "output": output,
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
    }


class ScriptedModel:
    """An OpenAI-compatible ``/v1/responses`` on a port of its own, in a thread: the task's
    ground-truth tool call first, then a closing message once it sees the tool's output."""

    def __init__(self, calls: list[dict[str, str]]) -> None:
        self.calls = calls
        self.requests: list[dict[str, Any]] = []
        model = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                model.requests.append({"path": self.path, "body": body})
                reply = json.dumps(model.answer(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        if any(item.get("type") == "function_call_output" for item in body["input"]):
            text = {"type": "output_text", "text": "Done.", "annotations": []}
            message = {"type": "message", "id": "msg-1", "role": "assistant"}
            return _response([{**message, "status": "completed", "content": [text]}])
        return _response(
            [
                {"type": "function_call", "call_id": f"call-{i}", "id": f"fc-{i}", **call}
                for i, call in enumerate(self.calls)
            ]
        )

    def __enter__(self) -> ScriptedModel:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def model(venv: Path) -> Iterator[ScriptedModel]:
    with ScriptedModel(_example_row(venv)["ground_truth"]) as scripted:
        yield scripted


@pytest.fixture(scope="module")
def gym(
    tmp_path_factory: pytest.TempPathFactory, model: ScriptedModel, venv: Path
) -> Iterator[GymServers]:
    logs = tmp_path_factory.mktemp("gym")
    with GymServers(logs, model_port=model.port, venv=venv) as servers:
        yield servers


def test_workplace_assistant_sessions_tools_and_verify(gym: GymServers, venv: Path) -> None:
    row = _example_row(venv)
    with httpx.Client(base_url=gym.resources_url, timeout=30) as client:
        seeded = client.post("/seed_session", json=row)
        assert (seeded.status_code, seeded.json()) == (200, {})
        assert list(client.cookies) == [SESSION_COOKIE]  # kept by the client from here on

        # Not idempotent: the same call twice is two events, with two ids (max id + 1).
        first = client.post("/calendar_create_event", json=EVENT)
        second = client.post("/calendar_create_event", json=EVENT)
        assert first.status_code == second.status_code == 200
        assert int(second.json()["output"]) == int(first.json()["output"]) + 1

        # A tool's own failure is HTTP 200 with the error as its output, for the model.
        unknown = client.post("/no_such_tool", json={})
        assert unknown.status_code == 200
        assert unknown.json()["output"].startswith("Error executing tool 'no_such_tool'")

    # No session cookie (or one the server does not hold): HTTP 400.
    unseeded = httpx.post(f"{gym.resources_url}/calendar_create_event", json=EVENT, timeout=30)
    assert unseeded.status_code == 400
    assert unseeded.json() == {"detail": "Session not initialized. Please call seed_session first."}

    # /verify replays the transcript's tool calls on fresh tables: no session needed.
    empty = httpx.post(f"{gym.resources_url}/verify", json={**row, "response": _response([])})
    assert empty.status_code == 200
    verdict = {"responses_create_params", "response", "reward"}
    if gym.version >= (0, 7):  # 0.7 says whether the reward measures the policy at all
        verdict |= {"mask_sample", "failure_kind", "failure_reason"}
        assert empty.json()["mask_sample"] is False
    assert set(empty.json()) == verdict
    assert empty.json()["reward"] == 0.0
    calls = [{"type": "function_call", "call_id": "c0", **call} for call in row["ground_truth"]]
    solved = httpx.post(f"{gym.resources_url}/verify", json={**row, "response": _response(calls)})
    assert solved.status_code == 200 and solved.json()["reward"] == 1.0


def test_simple_agent_runs_an_episode_through_the_configured_model(
    gym: GymServers, model: ScriptedModel, venv: Path
) -> None:
    """Through ``run_url``: on 0.7 the legacy_agent environment server, relaying to the agent."""
    assert (gym.version >= (0, 7)) == (gym.run_url != f"{gym.agent_url}/run")
    row = _example_row(venv)
    model.requests.clear()
    ran = httpx.post(gym.run_url, json=row, timeout=60)
    assert ran.status_code == 200, ran.text
    assert ran.json()["reward"] == 1.0  # the ground-truth call, run on the real tools
    assert [r["path"] for r in model.requests] == ["/v1/responses", "/v1/responses"]
    tool_outputs = [
        item
        for item in model.requests[1]["body"]["input"]
        if item.get("type") == "function_call_output"
    ]
    assert [item["call_id"] for item in tool_outputs] == ["call-0"]
    assert "Error" not in tool_outputs[0]["output"]  # a real reply, on a seeded session


@pytest.mark.parametrize("tool_proxy", [None, 40123], ids=["direct", "tool-proxy"])
def test_the_config_is_one_nemo_gym_validation_accepts(tool_proxy: int | None, venv: Path) -> None:
    python = gym_python(venv)
    environment = 40124 if gym_version(python) >= (0, 7) else None
    ports = GymPorts(40120, 40121, 40122, tool_proxy=tool_proxy, environment=environment)
    config = gym_config(ports, max_steps=4)
    check = (
        "import json, sys\n"
        "from omegaconf import OmegaConf\n"
        "from nemo_gym.global_config import GlobalConfigDictParser, get_first_server_config_dict\n"
        "parsed = GlobalConfigDictParser().parse_no_environment(OmegaConf.create(sys.argv[1]))\n"
        "print(json.dumps({s: OmegaConf.to_container(get_first_server_config_dict(parsed, s))\n"
        "                  for s in sys.argv[2:]}))\n"
    )
    sections = [RESOURCES_SECTION, AGENT_SECTION, MODEL_SECTION]
    sections += [TOOL_PROXY_SECTION] if tool_proxy else []
    sections += [ENVIRONMENT_SECTION] if environment else []
    out = subprocess.run(
        [str(python), "-c", check, json.dumps(config), *sections],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "WANDB_MODE": "disabled"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    resolved = json.loads(out.stdout.strip().splitlines()[-1])
    assert {s: resolved[s]["port"] for s in sections} == {
        RESOURCES_SECTION: 40120,
        AGENT_SECTION: 40121,
        MODEL_SECTION: 40122,
        **({TOOL_PROXY_SECTION: tool_proxy} if tool_proxy else {}),
        **({ENVIRONMENT_SECTION: environment} if environment else {}),
    }
    agent = resolved[AGENT_SECTION]
    assert agent["max_steps"] == 4
    assert agent["model_server"] == {"type": "responses_api_models", "name": MODEL_SECTION}
    expected = TOOL_PROXY_SECTION if tool_proxy else RESOURCES_SECTION
    assert agent["resources_server"] == {"type": "resources_servers", "name": expected}
    if environment:
        relay = resolved[ENVIRONMENT_SECTION]
        assert relay["agent_server"] == {"type": "responses_api_agents", "name": AGENT_SECTION}


# The process lifecycle is rollsafe's (rollsafe.http.served, launch.py), the same for either
# release: checked on the default venv (0.7) only.


def test_crash_sigkills_every_server_by_pid(tmp_path: Path, default_venv: Path) -> None:
    servers = GymServers(tmp_path, agent=False, venv=default_venv).start()
    try:
        assert servers.alive() == {RESOURCES_SECTION: True}
        pids = servers.pids()
        servers.crash()
        assert servers.alive() == {RESOURCES_SECTION: False}
        assert servers.processes[RESOURCES_SECTION].proc.returncode == -9
        for pid in pids.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        servers.stop()


def test_a_server_that_cannot_start_fails_start_and_the_rest_are_stopped(
    tmp_path: Path, default_venv: Path
) -> None:
    servers = GymServers(tmp_path, venv=default_venv)
    with socket.socket() as taken:  # the resources server's port, held: it cannot bind
        taken.bind(("127.0.0.1", servers.ports.resources))
        taken.listen()
        with pytest.raises(ServerDidNotStart, match="address already in use"):
            servers.start()
    assert set(servers.alive().values()) == {False}
    assert (ENVIRONMENT_SECTION in servers.alive()) == (servers.version >= (0, 7))


STARTER = """
import signal, sys
from pathlib import Path
from rollsafe.gym.servers import GymServers
servers = GymServers(Path(sys.argv[1]), agent=False, venv=Path(sys.argv[2])).start()
print(*servers.pids().values(), flush=True)
signal.pause()  # until the test kills it
"""


def test_servers_end_with_a_starter_killed_from_outside(tmp_path: Path, default_venv: Path) -> None:
    """The starter SIGKILLed runs no cleanup: each server ends on its own (launch.py watches
    ``ROLLSAFE_PARENT_PID``), none is left holding its port."""
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(tmp_path), str(default_venv)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert starter.stdout is not None
        pids = [int(pid) for pid in starter.stdout.readline().split()]
        assert pids, "the starter printed no pids"
    finally:
        starter.kill()
        starter.wait()
    for pid in pids:

        def ended(pid: int = pid) -> bool:
            return not _running(pid)

        eventually(ended, timeout_s=30, what=f"server {pid} to end")


def _running(pid: int) -> bool:
    """Alive and not a zombie (the starter is gone: init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
