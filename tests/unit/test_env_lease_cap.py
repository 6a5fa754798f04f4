"""A lease deadline past MAX_LEASE_S (issue 32): prepare, renew and restore refuse it over HTTP
with a 422 naming ``deadline_ts`` and the limit, and change nothing; deadlines within it go
through. The participant app on ``httpx.ASGITransport``, its clock fixed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from rollsafe.env import protocol as wire
from rollsafe.env.participant import MAX_LEASE_S, Participant
from rollsafe.env.router import participant_app
from rollsafe.testing.envs import Idle

TOKEN = "unit-token"
NOW = 1_000_000.0
P = wire.PREFIX
# Past the cap: the adversarial test's 1e308, and one second too far.
TOO_FAR = [1e308, NOW + MAX_LEASE_S + 1]


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    part = Participant("idle-0", Idle(), lease_grace_s=5.0, clock=lambda: NOW)
    transport = httpx.ASGITransport(app=participant_app(part, TOKEN))
    headers = {"authorization": f"Bearer {TOKEN}"}
    try:
        async with httpx.AsyncClient(
            transport=transport, base_url="http://env.test", headers=headers
        ) as client:
            yield client
    finally:
        await part.aclose()  # the lease watcher a lease started


async def post(http: httpx.AsyncClient, op: str, message: BaseModel) -> httpx.Response:
    return await http.post(f"{P}/{op}", content=message.model_dump_json())


async def status(http: httpx.AsyncClient) -> dict[str, Any]:
    reply: dict[str, Any] = (await http.get(f"{P}/status")).json()
    return reply


def capped(response: httpx.Response) -> None:
    assert response.status_code == 422, response.text
    reply = response.json()
    assert reply["error"] == "InvalidInput"
    assert "deadline_ts" in reply["detail"] and f"MAX_LEASE_S={MAX_LEASE_S:g}" in reply["detail"]


async def test_prepare_renew_and_restore_refuse_a_deadline_past_the_cap(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    for deadline in TOO_FAR:
        capped(
            await post(
                http, "prepare", wire.PrepareRequest(checkpoint_id="ck1", deadline_ts=deadline)
            )
        )
    assert (await status(http))["phase"] == "idle"  # nothing opened, the id not spent

    at_the_cap = wire.PrepareRequest(checkpoint_id="ck1", deadline_ts=NOW + MAX_LEASE_S)
    prepared = await post(http, "prepare", at_the_cap)
    assert prepared.status_code == 200, prepared.text
    lease = wire.PrepareReply.model_validate_json(prepared.content).lease_expires_ts
    for deadline in TOO_FAR:
        capped(
            await post(http, "renew", wire.RenewRequest(checkpoint_id="ck1", deadline_ts=deadline))
        )
    assert (await status(http))["lease_expires_ts"] == lease  # unchanged
    renewed = await post(
        http, "renew", wire.RenewRequest(checkpoint_id="ck1", deadline_ts=NOW + 60)
    )
    assert renewed.json() == {"lease_expires_ts": NOW + 60 + 5.0}

    commit = wire.CommitRequest(checkpoint_id="ck1", scope=(), dest=str(tmp_path))
    assert (await post(http, "commit", commit)).status_code == 200
    assert (await post(http, "resume", wire.ResumeRequest(checkpoint_id="ck1"))).status_code == 200
    source = {"source_checkpoint_id": "ck1", "root": str(tmp_path), "scope": ()}
    for deadline in TOO_FAR:
        restore = wire.RestoreRequest(restore_id="r1", deadline_ts=deadline, **source)
        capped(await post(http, "restore", restore))
    assert (await status(http))["phase"] == "idle"
    restore = wire.RestoreRequest(restore_id="r1", deadline_ts=NOW + 60, **source)
    restored = await post(http, "restore", restore)
    assert restored.status_code == 200, restored.text
    assert (await status(http))["phase"] == "restored"
