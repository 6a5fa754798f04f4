"""``rollsafe gateway serve``: an OpenAI-compatible gateway in front of rollsafe's engines whose
sessions are checkpointed (docs/gateway.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from rollsafe.cli.exits import EXIT_CODES, fail
from rollsafe.cli.options import LogFormatOption, LogLevelOption, PortOption, start_logging
from rollsafe.cli.tokens import (
    EngineToken,
    EngineTokenFile,
    EnvToken,
    EnvTokenFile,
    refused_token_option,
    required_token,
    resolve_token,
    token_file_option,
)
from rollsafe.env.participant import LEASE_GRACE_S
from rollsafe.errors import InvalidInput, RollsafeError
from rollsafe.gateway.agents import AgentProtocol
from rollsafe.http.bearer import ENGINE_TOKEN_ENV, ENV_TOKEN_ENV

if TYPE_CHECKING:
    from rollsafe.gateway.hooks import GatewayHooks

GATEWAY_TOKEN_ENV = "ROLLSAFE_GATEWAY_TOKEN"


def register_gateway_commands(app: typer.Typer) -> None:
    gateway_cli = typer.Typer(
        no_args_is_help=True, help="An OpenAI-compatible gateway whose sessions are durable."
    )
    app.add_typer(gateway_cli, name="gateway")
    gateway_cli.command("serve", epilog=EXIT_CODES)(gateway_serve)


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    """``NAME=VALUE`` options as a mapping; InvalidInput naming a malformed one."""
    pairs: dict[str, str] = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name or not rest:
            raise InvalidInput(f"{flag} {value!r}: expected NAME=VALUE")
        if name in pairs:
            raise InvalidInput(f"{flag}: {name} given twice")
        pairs[name] = rest
    return pairs


def gateway_serve(
    port: PortOption,
    model: Annotated[
        Path,
        typer.Option(help="the model directory: its tokenizer and chat template (make-model)"),
    ],
    engine_url: Annotated[
        list[str], typer.Option(help="an engine serving the model (repeat for several)")
    ],
    token_file: EnvTokenFile = None,
    token: EnvToken = None,
    engine_token_file: EngineTokenFile = None,
    engine_token: EngineToken = None,
    api_token_file: Annotated[
        Path | None, token_file_option("--api-token-file", GATEWAY_TOKEN_ENV)
    ] = None,
    api_token: Annotated[str | None, refused_token_option("--api-token", GATEWAY_TOKEN_ENV)] = None,
    agent_url: Annotated[
        str | None, typer.Option(help="the agent's episode endpoint, e.g. NeMo Gym's /run")
    ] = None,
    agent_protocol: Annotated[
        AgentProtocol,
        typer.Option(
            help="what --agent-url speaks: run (a flat dataset row: an agent's /run, NeMo Gym "
            "0.7's legacy_agent) or episode (NeMo Gym 0.7's typed episode protocol: "
            "single_agent_turn)",
        ),
    ] = "run",
    agent: Annotated[
        str | None, typer.Option(help="or an agent function: package.module:function")
    ] = None,
    tool_server: Annotated[
        list[str] | None,
        typer.Option(help="NAME=URL: a tool server behind the proxy (repeat for several)"),
    ] = None,
    tool_port: Annotated[
        list[str] | None, typer.Option(help="NAME=PORT: the proxy's port for NAME (default any)")
    ] = None,
    model_name: Annotated[
        str | None, typer.Option(help="the name /v1/models lists (default: the directory's)")
    ] = None,
    instance: Annotated[
        str | None, typer.Option(help="instance name (default gateway-<pid>)")
    ] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    lease_grace_s: Annotated[
        float, typer.Option(help="a checkpoint's lease runs this long past its deadline")
    ] = LEASE_GRACE_S,
    snapshot_root: Annotated[
        str | None, typer.Option(help="commit and restore may name no path outside it")
    ] = None,
    log_level: LogLevelOption = None,
    log_format: LogFormatOption = None,
) -> None:
    """Serve the gateway until SIGINT/SIGTERM. Prints `rollsafe gateway serving <instance> on
    http://host:port` once listening, and one `rollsafe gateway tools <name> on ...` line per
    tool proxy. Tokens: the run's checkpoint-protocol token from ROLLSAFE_ENV_TOKEN or
    --token-file, the engines' from ROLLSAFE_ENGINE_TOKEN or --engine-token-file, and the one
    agents must send to /v1 (default: none, loopback only) from ROLLSAFE_GATEWAY_TOKEN or
    --api-token-file."""
    import asyncio
    import os

    from rollsafe.gateway.serve import serve

    try:
        env_secret = required_token(token_file, file_flag="--token-file", envvar=ENV_TOKEN_ENV)
        engine_secret = required_token(
            engine_token_file, file_flag="--engine-token-file", envvar=ENGINE_TOKEN_ENV
        )
        api_secret = resolve_token(
            api_token_file, file_flag="--api-token-file", envvar=GATEWAY_TOKEN_ENV
        )
        start_logging(log_level, log_format)
        tools = _pairs(tool_server or [], "--tool-server")
        ports = {
            name: _port(value, name)
            for name, value in _pairs(tool_port or [], "--tool-port").items()
        }
        unknown = sorted(set(ports) - set(tools))
        if unknown:
            raise InvalidInput(f"--tool-port names {', '.join(unknown)}, not a --tool-server")
        name = instance or f"gateway-{os.getpid()}"
        entry = AgentFlags(agent_url, agent_protocol, agent)
        hooks = build_hooks(model, engine_url, engine_secret, entry, tools, model_name)
    except RollsafeError as exc:
        fail(exc)
    try:
        asyncio.run(
            serve(
                hooks,
                host=host,
                port=port,
                env_token=env_secret,
                api_token=api_secret,
                instance=name,
                tool_ports=ports,
                snapshot_root=snapshot_root,
                lease_grace_s=lease_grace_s,
            )
        )
    except RollsafeError as exc:
        fail(exc)


def _port(value: str, name: str) -> int:
    if not value.isdigit() or not 0 <= int(value) <= 65535:
        raise InvalidInput(f"--tool-port {name}={value}: not a port")
    return int(value)


@dataclass(frozen=True)
class AgentFlags:
    """How episodes start: ``--agent-url`` (speaking ``--agent-protocol``) or ``--agent``."""

    url: str | None
    protocol: AgentProtocol
    function: str | None


def build_hooks(
    model: Path,
    engine_urls: list[str],
    engine_token: str,
    entry: AgentFlags,
    tools: dict[str, str],
    model_name: str | None,
) -> GatewayHooks:
    """The gateway's hooks from the command's flags."""
    from rollsafe.engine.http import EngineClient
    from rollsafe.engine.text import ChatCodec
    from rollsafe.env.serve import load_hooks_factory
    from rollsafe.gateway.agents import FunctionAgent, HttpAgent
    from rollsafe.gateway.hooks import GatewayHooks
    from rollsafe.gateway.serve import EnginePool
    from rollsafe.gateway.sessions import Served
    from rollsafe.gateway.tools import ToolServer

    agent_url, agent = entry.url, entry.function
    if agent_url is not None and agent is not None:
        raise InvalidInput("give --agent-url or --agent, not both")
    codec = ChatCodec.load(model)
    engines = EnginePool([EngineClient(url, engine_token) for url in engine_urls])
    served = Served(engine=engines, codec=codec, model=model_name or model.name)
    servers = {name: ToolServer(name, url) for name, url in tools.items()}
    http = HttpAgent(agent_url, protocol=entry.protocol) if agent_url else None
    hooks = GatewayHooks(served, http, servers)
    if agent is not None:
        function = load_hooks_factory(agent)  # the same import rules as --hooks
        # hooks.url: where serve() listens, known once it bound its port (--port 0 too).
        hooks.agent = FunctionAgent(function, lambda session: f"{hooks.url}/sessions/{session}/v1")  # type: ignore[arg-type]
    return hooks
