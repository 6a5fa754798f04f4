"""Serve the gateway until SIGINT/SIGTERM: the main app and each tool proxy, every one on its
own port, under one uvicorn server (one set of signal handlers, one graceful shutdown).

Prints one line per port once listening::

    rollsafe gateway serving <instance> on http://host:port
    rollsafe gateway tools <server> on http://host:port
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import uvicorn

from rollsafe.engine.protocol import (
    CUT_BATCH,
    CutReport,
    Engine,
    EngineInfo,
    GenerateRequest,
    PrefixRecord,
    StreamEvent,
)
from rollsafe.env.participant import LEASE_GRACE_S, Participant
from rollsafe.errors import InvalidInput
from rollsafe.gateway.app import gateway_app, tool_app
from rollsafe.gateway.hooks import GatewayHooks
from rollsafe.http.served import server_config
from rollsafe.observability.tracing import configure_tracing

log = logging.getLogger(__name__)
GATEWAY_BANNER = r"rollsafe gateway serving {instance} on (http://\S+)"
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


class EnginePool:
    """Several engines serving one model, as one: a call goes to the engine its id hashes to
    (a resumed call may go to any: every engine of the pool has the model)."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        if not engines:
            raise InvalidInput("the gateway needs at least one --engine-url")
        self.engines = list(engines)

    def _for(self, call_id: str) -> Engine:
        digest = hashlib.sha256(call_id.encode()).digest()
        return self.engines[int.from_bytes(digest[:4], "big") % len(self.engines)]

    def generate(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        return self._for(request.call_id).generate(request)

    def resume(self, request: GenerateRequest, prefix: PrefixRecord) -> AsyncIterator[StreamEvent]:
        return self._for(request.call_id).resume(request, prefix)

    async def cut(self, call_ids: Sequence[str], *, batch_size: int = CUT_BATCH) -> CutReport:
        raise InvalidInput("cut the engines themselves (the run's participants), not the gateway")

    async def release(self, call_ids: Sequence[str]) -> int:
        raise InvalidInput("release on the engines themselves, not the gateway")

    async def info(self) -> EngineInfo:
        return await self.engines[0].info()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY only on sockets that say they
    # are TCP, and without it every reply waited ~40 ms for a delayed ACK (measured).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidInput(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, banners: Sequence[str]) -> None:
        super().__init__(config)
        self.banners = banners

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            for line in self.banners:
                print(line, flush=True)
                log.info("%s", line)


async def serve(  # noqa: PLR0913 (the serve command's options, passed on)
    hooks: GatewayHooks,
    *,
    host: str,
    port: int,
    env_token: str,
    api_token: str | None,
    instance: str,
    tool_ports: Mapping[str, int] | None = None,
    snapshot_root: str | os.PathLike[str] | None = None,
    lease_grace_s: float = LEASE_GRACE_S,
) -> None:
    """Serve ``hooks`` (see the module docstring). Without ``api_token`` the OpenAI API and
    the tool proxies take calls without one: only on a loopback address."""
    if not env_token:
        raise InvalidInput("the gateway needs the run's environment token (ROLLSAFE_ENV_TOKEN)")
    if api_token is None and host not in _LOOPBACK:
        raise InvalidInput(
            f"--host {host}: agents off this machine would reach an unauthenticated model; "
            "give --api-token-file (or listen on 127.0.0.1)"
        )
    configure_tracing()
    participant = Participant(
        instance, hooks, lease_grace_s=lease_grace_s, snapshot_root=snapshot_root
    )
    main = gateway_app(hooks, participant, env_token, api_token)
    sockets = [_bind(host, port)]
    hooks.url = _url(host, sockets[0])
    banners = [f"rollsafe gateway serving {instance} on {hooks.url}"]
    apps: dict[int, Any] = {}
    for name in hooks.tools:
        sock = _bind(host, (tool_ports or {}).get(name, 0))
        sockets.append(sock)
        apps[sock.getsockname()[1]] = tool_app(hooks, name, api_token)
        banners.append(f"rollsafe gateway tools {name} on {_url(host, sock)}")

    async def by_port(scope: dict[str, Any], receive: Any, send: Any) -> None:
        server = scope.get("server") or ("", 0)
        await apps.get(int(server[1] or 0), main)(scope, receive, send)

    config = server_config(by_port, host, port, lifespan="on")
    try:
        await _Server(config, banners).serve(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
        await hooks.aclose()
