"""Bearer tokens (issue 22, part 8) on the real servers: a run's engine and environment server
get tokens minted for the run through their environment, never argv; every endpoint each
serves refuses a missing or wrong token with 401 and changes nothing (the list of endpoints
is read from the apps themselves, so a new one cannot be left out); neither server writes a
token to its logs, not even a wrong one that contains it."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from rollsafe.engine.http import CutBody, ReleaseBody, engine_app
from rollsafe.engine.protocol import GenerateRequest, SamplingParams
from rollsafe.env import protocol as wire
from rollsafe.env.participant import Participant
from rollsafe.env.router import participant_app
from rollsafe.http.served import ServedProcess
from rollsafe.reference.envs.workplace.faults import FaultSwitches
from rollsafe.reference.rl.servers import RunServers
from rollsafe.testing.envs import Idle

A = wire.EpisodeRef(rollout_id="tok-0_g0", attempt=0)
CALL = GenerateRequest(
    call_id="tok-0_g0/t0", prompt_tokens=(1, 2, 3), sampling=SamplingParams(seed=1)
)


class Minted:
    """A run's tokens, minted for it, and one wrong token that contains each."""

    def __init__(self) -> None:
        self.engine, self.env = secrets.token_hex(16), secrets.token_hex(16)

    def wrong(self, token: str) -> list[dict[str, str]]:
        return [
            {},
            {"authorization": "Bearer not-the-token"},
            {"authorization": f"Basic {token}"},
            {"authorization": token},
            {"authorization": f"Bearer {token}x"},
            {"authorization": f"Bearer {token[:-1]}"},
        ]


@pytest.fixture
def minted() -> Minted:
    return Minted()


@pytest.fixture
def servers(tmp_path: Path, minted: Minted) -> Iterator[RunServers]:
    running = RunServers(
        tmp_path / "logs",
        ("w0",),
        seed=1,
        engine_token=minted.engine,
        env_token=minted.env,
        snapshot_root=tmp_path / "snapshots",
    )
    try:
        yield running
    finally:
        running.stop()


def guarded_routes(app: Any, open_paths: set[str]) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves but ``open_paths``."""
    found = []
    for route in app.routes:
        assert isinstance(route, Route), route
        for method in sorted((route.methods or set()) - {"HEAD"}):
            if route.path not in open_paths:
                found.append((method, route.path))
    return found


class NoEngine:
    """Stands in for an engine while the engine app's routes are listed (none is called)."""


def engine_bodies() -> dict[tuple[str, str], bytes]:
    """A body for each engine endpoint that, with the token, would change the engine."""
    routes = guarded_routes(engine_app(NoEngine(), "t"), {"/v1/health"})  # type: ignore[arg-type]
    bodies = {
        ("GET", "/v1/info"): b"",
        ("POST", "/v1/generate"): CALL.model_dump_json().encode(),
        ("POST", "/v1/resume"): b'{"request": ' + CALL.model_dump_json().encode() + b"}",
        ("POST", "/v1/cut"): CutBody(call_ids=(CALL.call_id,)).model_dump_json().encode(),
        ("POST", "/v1/release"): ReleaseBody(call_ids=(CALL.call_id,)).model_dump_json().encode(),
        ("POST", "/v1/weights"): b"\x00" * 64,
    }
    assert sorted(bodies) == sorted(routes), "an engine endpoint this test does not know"
    return bodies


def env_bodies(dest: Path) -> dict[tuple[str, str], bytes]:
    """A body for each environment endpoint that, with the token, would change the instance."""
    routes = guarded_routes(participant_app(Participant("x", Idle()), "t"), set())
    ck, deadline = "tok-ck1", time.time() + 600  # within the lease cap (MAX_LEASE_S)
    models: dict[str, Any] = {
        "status": None,
        "prepare": wire.PrepareRequest(checkpoint_id=ck, deadline_ts=deadline),
        "renew": wire.RenewRequest(checkpoint_id=ck, deadline_ts=deadline),
        "commit": wire.CommitRequest(checkpoint_id=ck, scope=(), dest=str(dest)),
        "resume": wire.ResumeRequest(checkpoint_id=ck),
        "retire": wire.RetireRequest(rollouts=(A,)),
        "forget": wire.ForgetRequest(rollouts=(A,)),
        "restore": wire.RestoreRequest(
            restore_id="tok-r1",
            source_checkpoint_id=ck,
            root=str(dest),
            scope=(A,),
            deadline_ts=deadline,
        ),
        "effects": wire.EffectsRequest(rollouts=(A.rollout_id,)),
        "lease": wire.RunLease(holder="tok-dispatcher", ttl_s=60),
    }
    bodies = {
        ("GET" if op == "status" else "POST", f"{wire.PREFIX}/{op}"): (
            model.model_dump_json().encode() if model is not None else b""
        )
        for op, model in models.items()
    }
    bodies[("POST", wire.EPISODES_RUN)] = wire.RunEpisode(episode=A).model_dump_json().encode()
    assert sorted(bodies) == sorted(routes), "an environment endpoint this test does not know"
    # The reference environment's own fault switches (served in front of the toolkit's app).
    bodies[("GET", "/faults")] = b""
    bodies[("POST", "/faults")] = FaultSwitches(unavailable=True).model_dump_json().encode()
    return bodies


async def refused_everywhere(
    url: str, bodies: dict[tuple[str, str], bytes], wrong: list[dict[str, str]]
) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for (method, path), body in bodies.items():
            for headers in wrong:
                sent = {**headers, "content-type": "application/json"}
                answer = await http.request(method, path, content=body, headers=sent)
                assert answer.status_code == 401, (method, path, headers, answer.text)
                assert answer.json()["error"] == "Unauthorized", (method, path)


async def engine_state(url: str, token: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        info = await http.get("/v1/info", headers={"authorization": f"Bearer {token}"})
        assert info.status_code == 200
        return dict(info.json())


async def arm(url: str, token: str, switches: FaultSwitches) -> None:
    auth = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        answer = await http.post("/faults", content=switches.model_dump_json(), headers=auth)
        assert answer.status_code == 200


async def env_state(url: str, token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    auth = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        status = (await http.get(f"{wire.PREFIX}/status", headers=auth)).json()
        switches = (await http.get("/faults", headers=auth)).json()
        return status, switches


def test_no_endpoint_takes_a_missing_or_wrong_token_and_no_token_is_in_argv_or_logs(
    servers: RunServers, minted: Minted, tmp_path: Path
) -> None:
    endpoints = servers.start()
    engine_url, env_url = endpoints.engine_url, endpoints.envs["w0"]
    for server in servers.current:  # through the environment, never argv (`ps` shows argv)
        assert isinstance(server, ServedProcess)  # a workplace run's: no NeMo Gym processes
        argv = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert minted.engine.encode() not in argv and minted.env.encode() not in argv

    before = asyncio.run(engine_state(engine_url, minted.engine))
    asyncio.run(refused_everywhere(engine_url, engine_bodies(), minted.wrong(minted.engine)))
    # The env token is not the engine's either way round.
    asyncio.run(refused_everywhere(engine_url, engine_bodies(), minted.wrong(minted.env)[1:2]))
    after = asyncio.run(engine_state(engine_url, minted.engine))
    # Not one hand-off to the engine loop but the info read's own.
    assert after == {**before, "handoffs": before["handoffs"] + 1}

    # Armed to exit on a retire: a retire without the token must not reach the switch either.
    asyncio.run(arm(env_url, minted.env, FaultSwitches(die_on="retire")))
    env_before = asyncio.run(env_state(env_url, minted.env))
    dest = tmp_path / "snapshots" / "tok"
    asyncio.run(refused_everywhere(env_url, env_bodies(dest), minted.wrong(minted.env)))
    assert asyncio.run(env_state(env_url, minted.env)) == env_before
    assert not dest.exists()

    # With the token the same bodies do change them (the checks above could fail).
    async def with_the_tokens() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            engine_auth = {"authorization": f"Bearer {minted.engine}"}
            generated = await http.post(
                f"{engine_url}/v1/generate", content=CALL.model_dump_json(), headers=engine_auth
            )
            assert generated.status_code == 200
            env_auth = {"authorization": f"Bearer {minted.env}"}
            prepare = env_bodies(dest)[("POST", f"{wire.PREFIX}/prepare")]
            parked = await http.post(
                f"{env_url}{wire.PREFIX}/prepare", content=prepare, headers=env_auth
            )
            assert parked.status_code == 200

    asyncio.run(with_the_tokens())
    assert asyncio.run(engine_state(engine_url, minted.engine))["handoffs"] > after["handoffs"] + 1
    assert asyncio.run(env_state(env_url, minted.env))[0]["phase"] == "prepared"

    servers.stop()  # everything they will log is written
    logged = [path for path in (tmp_path / "logs").rglob("*") if path.is_file()]
    assert logged, "the servers wrote no logs: nothing was checked"
    for path in logged:
        text = path.read_bytes()
        assert minted.engine.encode() not in text and minted.env.encode() not in text, path
