"""``rollsafe env serve workplace``: the workplace hooks in the toolkit's participant, served
over HTTP behind the fault switches, with the policy engine reached over HTTP."""

from __future__ import annotations

import os
from typing import Any

import uvicorn

from reference.envs.workplace.env import WorkplaceEnv
from reference.envs.workplace.faults import FaultMiddleware, FaultSwitches
from rollsafe.engine.http import EngineClient
from rollsafe.errors import InvalidInput
from rollsafe.served import listening_url, server_config


def default_instance() -> str:
    return f"workplace-{os.getpid()}"


class _Server(uvicorn.Server):
    """Prints the banner once listening."""

    def __init__(self, config: uvicorn.Config, instance: str) -> None:
        super().__init__(config)
        self.instance = instance

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            url = listening_url(self)
            print(f"rollsafe env serving workplace {self.instance} on {url}", flush=True)


async def serve(
    *,
    host: str,
    port: int,
    token: str,
    engine_url: str,
    engine_token: str,
    instance: str | None = None,
    lease_grace_s: float = 30.0,
    tool_wait_s: float = 5.0,
    faults: FaultSwitches | None = None,
    max_tokens: int = 12,
) -> None:
    """Serve one workplace instance until SIGINT/SIGTERM."""
    # Imported here: the toolkit is only needed to serve, not to use the pure calendar.
    from rollsafe.env.participant import Participant
    from rollsafe.env.router import participant_app

    if not token:
        raise InvalidInput("an environment server needs a non-empty token")
    name = instance or default_instance()
    engine = EngineClient(engine_url, engine_token)
    participant = Participant(
        name,
        WorkplaceEnv(engine, max_tokens=max_tokens),
        lease_grace_s=lease_grace_s,
        tool_wait_s=tool_wait_s,
    )
    app = FaultMiddleware(participant_app(participant, token), token, faults)
    # lifespan on: the app's lifespan runs the participant's lease watcher (a lease must run
    # out even when no request comes).
    config = server_config(app, host, port, lifespan="on")
    try:
        await _Server(config, name).serve()
    finally:
        await engine.aclose()
