"""NeMo Gym's real servers, unmodified, as processes rollsafe starts and stops.

NeMo Gym runs each server in an environment of its own, on a Python of its own (0.7: 3.13; 0.4:
3.12), so it lives in a venv of its own (``make setup`` builds ``.venv-gym`` with 0.7.0 and
``.venv-gym-0.4`` with 0.4.0; :func:`gym_python` finds one). Each server is ``<gym python>
launch.py <server dir>`` (:mod:`rollsafe.gym.launch`: no Ray cluster, a banner once it answers),
with the whole config in ``NEMO_GYM_CONFIG_DICT`` and its own section's name in
``NEMO_GYM_CONFIG_PATH``. Servers find each other only by the host and port in that config, so
every port is chosen before anything starts (:func:`gym_config`).

What runs (:class:`GymServers`), named by the resources server (:class:`GymResources`:
workplace_assistant by default, example_session_state_mgmt, or example_single_tool_call):

- ``workplace_assistant``: the real resources server (tools on per-session state,
  ``/seed_session``, ``/verify``).
- ``workplace_assistant_simple_agent``: simple_agent, whose ``resources_server`` is a tool
  proxy's address when one is given (else the real server's) and whose ``model_server`` is the
  ``policy_model`` section: an OpenAI-compatible model gateway's address. Neither the proxy nor
  the gateway is started here; their ports are in the config for whoever serves them.
- ``workplace_assistant_environment`` (NeMo Gym 0.7 and later, by default): the environment
  server the resources server's pairing has in 0.7, in front of simple_agent.
  ``legacy_agent``, as NeMo RL runs an agent that owns its episode: it relays ``/run`` (body,
  headers, cookies) to the agent and its answer back. ``single_agent_turn``
  (example_single_tool_call's), which owns the episode: it seeds the resources session (through
  the proxy) and an agent session granting the tools, makes one agent turn, verifies, and
  closes both. :attr:`GymServers.run_url` is where an episode starts (the environment server's
  ``/run`` when it runs, else the agent's), speaking :attr:`GymServers.agent_protocol`.

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
from rollsafe.gateway.agents import AgentProtocol
from rollsafe.http.served import START_TIMEOUT_S, ServedProcess

GYM_VENV_ENV = "ROLLSAFE_GYM_VENV"
GYM_VENV_DEFAULT = ".venv-gym"  # under the repository root: nemo-gym 0.7.0 (make setup)
GYM_EARLIER_VENV = ".venv-gym-0.4"  # beside it: nemo-gym 0.4.0, the release before (make setup)
# The first NeMo Gym with environment servers (environment_servers/legacy_agent).
ENVIRONMENT_SERVERS_SINCE = (0, 7)
LAUNCHER = Path(__file__).with_name("launch.py")
# What launch.py prints once the server answers: group 1 is its URL (launch.BANNER).
GYM_BANNER = r"nemo-gym serving {section} on (http://\S+)"

# The NeMo Gym environments ``rollsafe demo --gym`` runs.
GymEnvironment = Literal["workplace_assistant"]
MODEL_SECTION = "policy_model"  # the agent's model server: the gateway
# Where the agent's and the environment server's app.py live inside the venv's site-packages.
AGENT_DIR = "responses_api_agents/simple_agent"
# NeMo Gym 0.7's environment servers rollsafe runs in front of simple_agent: legacy_agent
# relays the agent's own /run (the agent owns the episode, a flat row in); single_agent_turn
# owns the episode itself (the typed episode protocol: it seeds the resources and agent
# sessions, makes one agent turn, verifies and closes them), for a migrated pairing.
EnvironmentKind = Literal["legacy_agent", "single_agent_turn"]


@dataclass(frozen=True)
class GymResources:
    """A NeMo Gym resources server run with simple_agent, and its sections' names (the
    config's top-level keys; ``NEMO_GYM_CONFIG_PATH`` names one), as its own configs name them."""

    name: str  # its folder under resources_servers/, and its section
    description: str  # its config's
    max_steps: int | None  # simple_agent's, as its config for this server sets it (None: none)
    environment: EnvironmentKind = "legacy_agent"  # its pairing's environment server (0.7)

    @property
    def dir(self) -> str:
        return f"resources_servers/{self.name}"

    @property
    def agent_section(self) -> str:
        return f"{self.name}_simple_agent"

    @property
    def tool_proxy_section(self) -> str:
        return f"{self.name}_tool_proxy"

    @property
    def environment_section(self) -> str:
        return f"{self.name}_environment"

    def example_rows(self, python: Path | None = None) -> list[dict[str, Any]]:
        """Its own ``data/example.jsonl``, one task per row."""
        data = gym_site_packages(python) / self.dir / "data" / "example.jsonl"
        return [json.loads(line) for line in data.read_text().splitlines() if line.strip()]


WORKPLACE = GymResources(
    "workplace_assistant", "Workplace assistant multi-step tool-using environment", 6
)
# A counter per session: increment_counter is no more idempotent than a calendar event, and
# /verify scores the count, so an increment made twice is a wrong reward.
SESSION_STATE = GymResources(
    "example_session_state_mgmt", "Session state management (in-memory)", 8
)
# A weather tool: the pairing NeMo Gym 0.7 migrated to single_agent_turn (its own config).
SINGLE_TOOL_CALL = GymResources(
    "example_single_tool_call", "Basic single-step tool calling", None, "single_agent_turn"
)
# workplace_assistant's sections, by the names the tests and the demo use.
RESOURCES_SECTION = WORKPLACE.name
AGENT_SECTION = WORKPLACE.agent_section
TOOL_PROXY_SECTION = WORKPLACE.tool_proxy_section
ENVIRONMENT_SECTION = WORKPLACE.environment_section


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


def gym_python(venv: Path | None = None) -> Path:
    """The Python of ``venv`` (default :func:`gym_venv`); :class:`InvalidInput` naming
    ``make setup`` if it is missing."""
    venv = venv or gym_venv()
    python = venv / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise InvalidInput(
            f"no NeMo Gym venv at {venv} (no {python}): run `make setup`, which builds "
            f"{GYM_VENV_DEFAULT} (nemo-gym 0.7.0, Python 3.13) and {GYM_EARLIER_VENV} (0.4.0, "
            f"Python 3.12), or set {GYM_VENV_ENV} to such a venv"
        )
    return python


def gym_version(python: Path | None = None) -> tuple[int, ...]:
    """The nemo-gym release installed beside ``python`` (default :func:`gym_python`), as
    numbers: ``(0, 7, 0)``. Read from its dist-info, without starting the interpreter."""
    site = gym_site_packages(python)
    found = sorted(site.glob("nemo_gym-*.dist-info"))
    if not found:
        raise InvalidInput(f"no nemo_gym-*.dist-info in {site}: run `make setup`")
    version = found[-1].name.removeprefix("nemo_gym-").removesuffix(".dist-info")
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


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
    """Every address in a config: the servers run here, and our two in between."""

    resources: int  # the real resources server
    agent: int  # simple_agent
    model: int  # the OpenAI-compatible model gateway (``policy_model``)
    tool_proxy: int | None = None  # the tool proxy to ``resources``; None: none, direct
    environment: int | None = None  # the environment server in front of the agent; None: none


def gym_config(
    ports: GymPorts,
    *,
    host: str = "127.0.0.1",
    max_steps: int | None = None,
    resources: GymResources = WORKPLACE,
) -> dict[str, Any]:
    """The resolved NeMo Gym config (``NEMO_GYM_CONFIG_DICT``) for ``resources``, its
    simple_agent (``max_steps``: the server's own), the model gateway, (if
    ``ports.tool_proxy``) the tool proxy and (if ``ports.environment``) the environment server.

    A server started with this config reads it as is (nemo_gym validates only when it
    resolves YAML itself, in ``ng_run``/``ng_dump_config``); it is still a config that
    validation accepts: the sections the agent's refs name are server sections of the ref's
    type (a resources server needs ``domain``, every server an ``entrypoint``). The gateway's and
    the proxy's ``entrypoint`` are never run by nemo_gym: rollsafe serves those addresses.
    """

    def server(kind: str, name: str, port: int, **fields: Any) -> dict[str, Any]:
        return {kind: {name: {"entrypoint": "app.py", "host": host, "port": port, **fields}}}

    proxied = ports.tool_proxy is not None
    resources_ref = resources.tool_proxy_section if proxied else resources.name
    config: dict[str, Any] = {
        # No head server runs: each server only reads this section (ServerClient). Port 0
        # refuses at once anything that would try to reach it.
        "head_server": {"host": host, "port": 0},
        "dry_run": False,
        resources.name: server(
            "resources_servers",
            resources.name,
            ports.resources,
            domain="agent",
            verified=False,
            description=resources.description,
        ),
        MODEL_SECTION: server("responses_api_models", "rollsafe_model_gateway", ports.model),
        resources.agent_section: server(
            "responses_api_agents",
            "simple_agent",
            ports.agent,
            resources_server={"type": "resources_servers", "name": resources_ref},
            model_server={"type": "responses_api_models", "name": MODEL_SECTION},
        ),
    }
    steps = resources.max_steps if max_steps is None else max_steps
    if steps is not None:
        config[resources.agent_section]["responses_api_agents"]["simple_agent"]["max_steps"] = steps
    if ports.tool_proxy is not None:
        config[resources.tool_proxy_section] = server(
            "resources_servers", "rollsafe_tool_proxy", ports.tool_proxy, domain="agent"
        )
    if ports.environment is not None:
        config[resources.environment_section] = server(
            "environment_servers",
            resources.environment,
            ports.environment,
            **_environment_fields(resources, resources_ref),
        )
    return config


def _environment_fields(resources: GymResources, resources_ref: str) -> dict[str, Any]:
    """An environment server's config, as its own configs/<kind>.yaml has it: the base's limits
    (which a relay does not enforce; setting others would warn), the agent, and for
    single_agent_turn the resources server it seeds (our proxy, when there is one) and the
    direct HTTP tool access it grants the agent."""
    fields: dict[str, Any] = {
        "agent_server": {"type": "responses_api_agents", "name": resources.agent_section},
        "max_concurrent_episodes": None,
        "queue_timeout_seconds": None,
        "default_episode_timeout_seconds": 21600,
        "cleanup_timeout_seconds": 180,
    }
    if resources.environment == "single_agent_turn":
        fields["resources_server"] = {"type": "resources_servers", "name": resources_ref}
        fields["resources_tool_transports"] = ["direct_http"]
    return fields


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
    """A resources server (``resources``, default workplace_assistant) and (``agent=True``)
    simple_agent, as processes of a gym venv (``venv``, default :func:`gym_venv`), with
    (``environment_server``; default: where the release has them) the environment server of
    the resources server's 0.7 pairing (``resources.environment``) in front of the agent.

    Ports are chosen on construction (:attr:`ports`, :attr:`config`, :attr:`run_url`), so the
    model gateway and the tool proxy can be started on theirs, before or after :meth:`start`.
    A context manager: started on entry, stopped on exit. Logs: ``logs/<section>/stdout`` and
    ``stderr``.
    """

    def __init__(
        self,
        logs: Path,
        *,
        model_port: int | None = None,
        tool_proxy_port: int | None = None,
        agent: bool = True,
        environment_server: bool | None = None,
        venv: Path | None = None,
        resources: GymResources = WORKPLACE,
        host: str = "127.0.0.1",
    ) -> None:
        self.logs = logs
        self.resources = resources
        self.host = host
        self.with_agent = agent
        self.python = gym_python(venv)
        self.version = gym_version(self.python)
        has_them = self.version >= ENVIRONMENT_SERVERS_SINCE
        if environment_server is None:
            environment_server = agent and has_them
        if environment_server and not (agent and has_them):
            raise InvalidInput(
                f"an environment server needs the agent and nemo-gym >= 0.7 (this venv has "
                f"{'.'.join(map(str, self.version))}{'' if agent else ', and no agent'})"
            )
        resources_port, agent_port, model, environment = free_ports(4, host)
        self.ports = GymPorts(
            resources=resources_port,
            agent=agent_port,
            model=model_port if model_port is not None else model,
            tool_proxy=tool_proxy_port,
            environment=environment if environment_server else None,
        )
        self.config = gym_config(self.ports, host=host, resources=resources)
        self.processes: dict[str, ServedProcess] = {}  # by section, in start order
        self.startup_s: dict[str, float] = {}  # by section: start to banner

    @property
    def resources_url(self) -> str:
        return self.processes[self.resources.name].url

    @property
    def agent_url(self) -> str:
        return self.processes[self.resources.agent_section].url

    @property
    def agent_protocol(self) -> AgentProtocol:
        """What :attr:`run_url` speaks: a flat row (the agent's /run, legacy_agent's relay), or
        the typed episode protocol (single_agent_turn)."""
        on_episodes = self.ports.environment is not None
        return "episode" if on_episodes and self.resources.environment != "legacy_agent" else "run"

    @property
    def run_url(self) -> str:
        """Where an episode starts (``POST`` the task): the environment server's ``/run``
        when one runs, else the agent's. Known before :meth:`start`."""
        port = self.ports.environment if self.ports.environment is not None else self.ports.agent
        return f"http://{self.host}:{port}/run"

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
        resources = self.resources
        wanted = [(resources.name, resources.dir)]
        if self.with_agent:
            wanted.append((resources.agent_section, AGENT_DIR))
        if self.ports.environment is not None:
            wanted.append(
                (resources.environment_section, f"environment_servers/{resources.environment}")
            )
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
                served.wait_listening(GYM_BANNER.format(section=section), START_TIMEOUT_S)
                self.startup_s[section] = time.monotonic() - began[section]
        except BaseException:
            self.stop()
            raise
        return self

    def alive(self) -> dict[str, bool]:
        return {section: served.alive() for section, served in self.processes.items()}

    def stop(self) -> None:
        """Terminate each by pid (the last started first), wait, kill any that will not go."""
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
