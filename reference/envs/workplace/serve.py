"""``rollsafe env serve workplace``: the workplace hooks served by the toolkit
(:func:`rollsafe.env.serve.serve`) behind the fault switches, with the policy engine reached
over HTTP."""

from __future__ import annotations

from reference.envs.workplace.env import WorkplaceEnv
from reference.envs.workplace.faults import FaultMiddleware, FaultSwitches
from rollsafe.engine.http import EngineClient
from rollsafe.env.serve import Asgi, serve


async def serve_workplace(
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
    engine = EngineClient(engine_url, engine_token)

    def with_faults(app: Asgi) -> Asgi:
        return FaultMiddleware(app, token, faults)

    try:
        await serve(
            WorkplaceEnv(engine, max_tokens=max_tokens),
            host=host,
            port=port,
            token=token,
            instance=instance,
            lease_grace_s=lease_grace_s,
            tool_wait_s=tool_wait_s,
            wrap=with_faults,
        )
    finally:
        await engine.aclose()
