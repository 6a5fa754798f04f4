"""``rollsafe doctor``'s checks of the run's environment instances (``participants.envs``):
each answers its status with the run's token, under the name the run gives it."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import httpx

from rollsafe.cli.doctor.checks import DoctorCheck, failed, ok, skipped
from rollsafe.env.client import EnvClient
from rollsafe.env.fleet_instances import misnamed
from rollsafe.errors import RollsafeError
from rollsafe.settings import ParticipantsSection

ENVS = "environment instances"


async def env_checks(
    participants: ParticipantsSection,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[DoctorCheck]:
    """One row per instance of ``participants.envs`` (a skipped row when there is none);
    ``env``: where the token variable is read (None: os.environ); ``transport``: httpx's, for
    tests."""
    if not participants.envs:
        return [skipped(ENVS, "participants.envs is empty: the run parks no environment")]
    try:
        token = participants.env_token(env)
    except RollsafeError as exc:
        fix = "set ROLLSAFE_ENV_TOKEN, or participants.env_token_file"
        return [failed(ENVS, str(exc), fix)]
    checks = (
        _env_check(name, url, EnvClient(url, token, timeout_s=timeout_s, transport=transport))
        for name, url in sorted(participants.envs.items())
    )
    return list(await asyncio.gather(*checks))


async def _env_check(name: str, url: str, client: EnvClient) -> DoctorCheck:
    check = f"environment {name}"
    try:
        async with client:
            status = await client.status()
    except RollsafeError as exc:
        fix = f"start it (`rollsafe env serve ... --instance {name}`) with the run's token"
        return failed(check, str(exc), fix)
    if status.instance != name:
        fix = f"restart it with `--instance {name}`, or rename it in participants.envs"
        return failed(check, misnamed(name, url, status.instance), fix)
    return ok(check, f"{url}: instance {name}, {status.phase}, {status.live_episodes} live")
