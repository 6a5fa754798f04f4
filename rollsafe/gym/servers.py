"""NeMo Gym's real servers, unmodified, as processes rollsafe starts and stops.

NeMo Gym 0.4.0 needs Python >= 3.12 and runs each server in its own environment, so it lives in
a venv of its own (``make setup`` builds ``.venv-gym``; :func:`gym_python` finds it). Each
server is ``<gym python> launch.py <server dir>`` (:mod:`rollsafe.gym.launch`: no Ray cluster,
a banner once it answers), with the whole config in ``NEMO_GYM_CONFIG_DICT`` and its own
section's name in ``NEMO_GYM_CONFIG_PATH``. Servers find each other only by the host and port
in that config, so every port is chosen before anything starts (:func:`gym_config`).

What runs (:class:`GymServers`):

- ``workplace_assistant``: the real resources server (tools on per-session tables,
  ``/seed_session``, ``/verify``).
- ``workplace_assistant_simple_agent``: simple_agent, whose ``resources_server`` is a tool
  proxy's address when one is given (else the real server's) and whose ``model_server`` is the
  ``policy_model`` section: an OpenAI-compatible model gateway's address. Neither the proxy nor
  the gateway is started here; their ports are in the config for whoever serves them.

Processes are ended by their pid, never by name (:class:`rollsafe.http.served.ServedProcess`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from rollsafe.errors import InvalidInput
from rollsafe.http.served import START_TIMEOUT_S, ServedProcess

GYM_VENV_ENV = "ROLLSAFE_GYM_VENV"
GYM_VENV_DEFAULT = ".venv-gym"  # under the repository root
LAUNCHER = Path(__file__).with_name("launch.py")
# What launch.py prints once the server answers: group 1 is its URL (launch.BANNER).
GYM_BANNER = r"nemo-gym serving {section} on (http://\S+)"

# The NeMo Gym environments rollsafe runs (``rollsafe demo --gym``).
GymEnvironment = Literal["workplace_assistant"]
# Section names (the config's top-level keys; NEMO_GYM_CONFIG_PATH names one).
RESOURCES_SECTION = "workplace_assistant"
AGENT_SECTION = "workplace_assistant_simple_agent"
TOOL_PROXY_SECTION = "workplace_assistant_tool_proxy"
MODEL_SECTION = "policy_model"
# Where each server's app.py lives inside the gym venv's site-packages.
RESOURCES_DIR = "resources_servers/workplace_assistant"
AGENT_DIR = "responses_api_agents/simple_agent"
DEFAULT_MAX_STEPS = 6  # simple_agent's own config for workplace_assistant


def repo_root() -> Path:
    """The rollsafe checkout this package runs from (an editable install), else the cwd."""
    candidate = Path(__file__).resolve().parents[2]
    if (candidate / "pyproject.toml").is_file() and (candidate / "rollsafe").is_dir():
        return candidate
    return Path.cwd()


def gym_venv() -> Path:
    """The NeMo Gym venv: ``$ROLLSAFE_GYM_VENV``, else ``<repo>/.venv-gym``."""
    configured = os.environ.get(GYM_VENV_ENV)
    return Path(configured) if configured else repo_root() / GYM_VENV_DEFAULT


def gym_python() -> Path:
    """The NeMo Gym venv's Python; :class:`InvalidInput` naming ``make setup`` if missing."""
    venv = gym_venv()
    python = venv / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise InvalidInput(
            f"no NeMo Gym venv at {venv} (no {python}): run `make setup`, which builds it with "
            f"Python 3.12 and nemo-gym==0.4.0, or set {GYM_VENV_ENV} to such a venv"
        )
    return python


def gym_site_packages(python: Path | None = None) -> Path:
    """The gym venv's site-packages, where NeMo Gym's servers and their data lie
    (``resources_servers/workplace_assistant/data/example.jsonl``)."""
    python = python or gym_python()
    found = sorted((python.parent.parent / "lib").glob("python3.*/site-packages/nemo_gym"))
    if found:
        return found[-1].parent
    out = subprocess.run(
        [str(python), "-c", "import nemo_gym; print(nemo_gym.PARENT_DIR)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise InvalidInput(f"{python} cannot import nemo_gym: run `make setup`\n{out.stderr}")
    return Path(out.stdout.strip())


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports nothing listens on now (bound to 0 together, then released):
    every server's port must be in the config before any of them starts."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass(frozen=True)
class GymPorts:
    """Every address in a config: the two servers run here, and our two in between."""

    resources: int  # the real workplace_assistant resources server
    agent: int  # simple_agent
    model: int  # the OpenAI-compatible model gateway (``policy_model``)
    tool_proxy: int | None = None  # the tool proxy to ``resources``; None: none, direct


def gym_config(
    ports: GymPorts, *, host: str = "127.0.0.1", max_steps: int = DEFAULT_MAX_STEPS
) -> dict[str, Any]:
    """The resolved NeMo Gym config (``NEMO_GYM_CONFIG_DICT``) for workplace_assistant, its
    simple_agent, the model gateway and (if ``ports.tool_proxy``) the tool proxy.

    A server started with this config reads it as is (nemo_gym validates only when it
    resolves YAML itself, in ``ng_run``/``ng_dump_config``); it is still a config that
    validation accepts: the sections the agent's refs name are server sections of the ref's
    type (a resources server needs ``domain``, every server an ``entrypoint``). The gateway's and
    the proxy's ``entrypoint`` are never run by nemo_gym: rollsafe serves those addresses.
    """

    def server(kind: str, name: str, port: int, **fields: Any) -> dict[str, Any]:
        return {kind: {name: {"entrypoint": "app.py", "host": host, "port": port, **fields}}}

    resources_ref = RESOURCES_SECTION if ports.tool_proxy is None else TOOL_PROXY_SECTION
    config: dict[str, Any] = {
        # No head server runs: each server only reads this section (ServerClient). Port 0
        # refuses at once anything that would try to reach it.
        "head_server": {"host": host, "port": 0},
        "dry_run": False,
        RESOURCES_SECTION: server(
            "resources_servers",
            "workplace_assistant",
            ports.resources,
            domain="agent",
            verified=False,
            description="Workplace assistant multi-step tool-using environment",
        ),
        MODEL_SECTION: server("responses_api_models", "rollsafe_model_gateway", ports.model),
        AGENT_SECTION: server(
            "responses_api_agents",
            "simple_agent",
            ports.agent,
            max_steps=max_steps,
            resources_server={"type": "resources_servers", "name": resources_ref},
            model_server={"type": "responses_api_models", "name": MODEL_SECTION},
        ),
    }
    if ports.tool_proxy is not None:
        config[TOOL_PROXY_SECTION] = server(
            "resources_servers", "rollsafe_tool_proxy", ports.tool_proxy, domain="agent"
        )
    return config


def _environment(config: dict[str, Any], section: str) -> dict[str, str]:
    return {
        "NEMO_GYM_CONFIG_DICT": json.dumps(config),  # JSON is YAML: OmegaConf.create reads it
        "NEMO_GYM_CONFIG_PATH": section,
        "RAY_AUTH_MODE": "disabled",  # never switch this machine's Ray clients to token auth
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONUNBUFFERED": "1",
        # The gym venv's own packages only: empty counts as unset for Python.
        "PYTHONPATH": "",
        "PYTHONHOME": "",
    }


class GymServers:
    """workplace_assistant and (``agent=True``) simple_agent, as processes of the gym venv.

    Ports are chosen on construction (:attr:`ports`, :attr:`config`), so the model gateway and
    the tool proxy can be started on theirs, before or after :meth:`start`. A context manager:
    started on entry, stopped on exit. Logs: ``logs/<section>/stdout`` and ``stderr``.
    """

    def __init__(
        self,
        logs: Path,
        *,
        model_port: int | None = None,
        tool_proxy_port: int | None = None,
        agent: bool = True,
        max_steps: int = DEFAULT_MAX_STEPS,
        host: str = "127.0.0.1",
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.logs = logs
        self.host = host
        self.with_agent = agent
        self.start_timeout_s = start_timeout_s
        self.python = gym_python()
        resources, agent_port, model = free_ports(3, host)
        self.ports = GymPorts(
            resources=resources,
            agent=agent_port,
            model=model_port if model_port is not None else model,
            tool_proxy=tool_proxy_port,
        )
        self.config = gym_config(self.ports, host=host, max_steps=max_steps)
        self.processes: dict[str, ServedProcess] = {}  # by section, in start order
        self.startup_s: dict[str, float] = {}  # by section: start to banner

    @property
    def resources_url(self) -> str:
        return self.processes[RESOURCES_SECTION].url

    @property
    def agent_url(self) -> str:
        return self.processes[AGENT_SECTION].url

    @property
    def model_url(self) -> str:
        """Where the agent sends ``/v1/responses``: the gateway's address (not served here)."""
        return f"http://{self.host}:{self.ports.model}"

    @property
    def tool_proxy_url(self) -> str | None:
        if self.ports.tool_proxy is None:
            return None
        return f"http://{self.host}:{self.ports.tool_proxy}"

    def pids(self) -> dict[str, int]:
        return {section: served.proc.pid for section, served in self.processes.items()}

    def start(self) -> GymServers:
        """Start every server, then wait until each answers; on any failure stop them all and
        raise (:class:`rollsafe.errors.ServerDidNotStart`, its stderr tail included)."""
        wanted = [(RESOURCES_SECTION, RESOURCES_DIR)]
        if self.with_agent:
            wanted.append((AGENT_SECTION, AGENT_DIR))
        try:
            began = {}
            for section, server_dir in wanted:  # all at once: each takes ~2 s of imports
                began[section] = time.monotonic()
                self.processes[section] = ServedProcess(
                    [str(self.python), str(LAUNCHER), server_dir],
                    self.logs / section,
                    _environment(self.config, section),
                )
            for section, served in self.processes.items():
                served.wait_listening(GYM_BANNER.format(section=section), self.start_timeout_s)
                self.startup_s[section] = time.monotonic() - began[section]
        except BaseException:
            self.stop()
            raise
        return self

    def alive(self) -> dict[str, bool]:
        return {section: served.alive() for section, served in self.processes.items()}

    def stop(self) -> None:
        """Terminate each by pid (the agent first), wait, kill any that will not go."""
        for served in reversed(self.processes.values()):
            served.stop()

    def crash(self) -> None:
        """SIGKILL each by pid: its sessions die with it, as on a machine failure."""
        for served in reversed(self.processes.values()):
            served.crash()

    def __enter__(self) -> GymServers:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
