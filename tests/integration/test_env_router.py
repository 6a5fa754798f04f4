"""The participant over HTTP: a real uvicorn server on a loopback port (started in this test's
loop, stopped through ``should_exit``), and a hypothesis fuzz of every endpoint in-process."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from rollsafe.env import protocol as wire
from rollsafe.env.hooks import EnvironmentHooks, EpisodeSession
from rollsafe.env.participant import Participant
from rollsafe.env.protocol import EpisodeRef, EpisodeResult, RunEpisode
from rollsafe.env.router import participant_app
from rollsafe.testing.waiting import eventually_async

TOKEN = "participant-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
A, B = (EpisodeRef(rollout_id=f"run-{i}_g0", attempt=0) for i in range(2))
P = wire.PREFIX
BODIES: dict[str, type[BaseModel]] = {
    f"{P}/prepare": wire.PrepareRequest,
    f"{P}/renew": wire.RenewRequest,
    f"{P}/commit": wire.CommitRequest,
    f"{P}/resume": wire.ResumeRequest,
    f"{P}/retire": wire.RetireRequest,
    f"{P}/forget": wire.ForgetRequest,
    f"{P}/restore": wire.RestoreRequest,
    wire.EPISODES_RUN: RunEpisode,
}


class Gated(EnvironmentHooks):
    """Two turns; after the first, an episode with a gate waits on it (between turns)."""

    name = "gated"

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.turns: dict[str, int] = {}

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        key = run.episode.key
        self.turns[key] = session.restored["turn"] if session.restored else 0
        while self.turns[key] < 2:
            await session.boundary(self.turns[key])
            with session.tool():
                self.turns[key] += 1
            if key in self.gates:
                await self.gates[key].wait()
        return EpisodeResult(episode=run.episode, reward=0.5, turns=2, restored=False)

    def export_episode(self, episode: EpisodeRef) -> dict[str, Any]:
        return {"turn": self.turns[episode.key]}

    def drop_episode(self, episode: EpisodeRef) -> None:
        self.turns.pop(episode.key, None)


@asynccontextmanager
async def serving(participant: Participant) -> AsyncIterator[httpx.AsyncClient]:
    """The app under uvicorn on 127.0.0.1, port 0 (the OS picks); a client without a token."""
    config = uvicorn.Config(
        participant_app(participant, TOKEN),
        host="127.0.0.1",
        port=0,
        lifespan="on",
        log_level="warning",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        await eventually_async(lambda: server.started or task.done(), what="uvicorn started")
        assert not task.done(), "uvicorn did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            yield client
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def status(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get(f"{P}/status", headers=AUTH)
    assert response.status_code == 200
    return dict(response.json())


async def _phase_is(client: httpx.AsyncClient, phase: str) -> bool:
    current: str = (await status(client))["phase"]
    return current == phase


def later() -> float:
    """A deadline no test here reaches, within the lease cap (MAX_LEASE_S)."""
    return time.time() + 600


def body(model: BaseModel) -> str:
    return model.model_dump_json()


async def test_full_checkpoint_over_http(tmp_path: Path) -> None:
    env = Gated()
    env.gates[A.key] = asyncio.Event()
    async with serving(Participant("gated-0", env)) as http:
        run = asyncio.ensure_future(
            http.post(wire.EPISODES_RUN, content=body(RunEpisode(episode=A)), headers=AUTH)
        )
        await eventually_async(lambda: env.turns.get(A.key) == 1, what="A done its first turn")
        ck = wire.PrepareRequest(checkpoint_id="ck1", deadline_ts=later())
        prepare = asyncio.ensure_future(http.post(f"{P}/prepare", content=body(ck), headers=AUTH))
        # Admission closes with ck1 open: only then may A go on (or it would run to its end).
        await eventually_async(
            lambda: _phase_is(http, "prepared"), what="prepare opened ck1 (admission closed)"
        )
        env.gates[A.key].set()  # A goes on to its next boundary and parks there
        reply = wire.PrepareReply.model_validate_json((await prepare).content)
        assert reply.ready and [(p.episode, p.turn) for p in reply.parked] == [(A, 1)]

        parked = await http.post(
            wire.EPISODES_RUN, content=body(RunEpisode(episode=B)), headers=AUTH
        )
        assert parked.status_code == 409 and parked.json()["error"] == "checkpoint_parked"
        assert wire.ErrorReply.model_validate_json(parked.content)

        commit = wire.CommitRequest(checkpoint_id="ck1", scope=(A,), dest=str(tmp_path))
        done = await http.post(f"{P}/commit", content=body(commit), headers=AUTH)
        assert done.status_code == 200, done.text
        manifest = wire.CommitReply.model_validate_json(done.content).participants[0]
        line = json.loads((tmp_path / manifest.file).read_text())
        parked_at = {"turn": 1, "activity": "boundary", "model_call_id": None}
        record = {"episode": A.model_dump(), "state": {"turn": 1}, "parked": parked_at}
        assert line == {**record, "effects": []}  # the toy makes none
        assert (await status(http))["phase"] == "committed" and not run.done()

        resume = wire.ResumeRequest(checkpoint_id="ck1")
        resumed = await http.post(f"{P}/resume", content=body(resume), headers=AUTH)
        assert resumed.json() == {"phase": "idle", "resumed": True}
        result = await asyncio.wait_for(run, 5)
        assert result.status_code == 200 and EpisodeResult.model_validate_json(result.content)
        again = await http.post(f"{P}/prepare", content=body(ck), headers=AUTH)
        assert again.status_code == 409 and again.json()["error"] == "checkpoint_resumed"


async def test_wrong_token_changes_nothing(tmp_path: Path) -> None:
    valid = {
        f"{P}/prepare": wire.PrepareRequest(checkpoint_id="ck1", deadline_ts=later()),
        f"{P}/retire": wire.RetireRequest(rollouts=(A,)),
        f"{P}/resume": wire.ResumeRequest(checkpoint_id="ck1"),
        wire.EPISODES_RUN: RunEpisode(episode=A),
    }
    part = Participant("gated-0", Gated())
    async with serving(part) as http:
        before = await status(http)
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": TOKEN}):
            answer = await http.get(f"{P}/status", headers=headers)
            assert answer.status_code == 401 and answer.json()["error"] == "Unauthorized"
            for path, model in valid.items():
                answer = await http.post(path, content=body(model), headers=headers)
                assert answer.status_code == 401 and answer.json()["error"] == "Unauthorized"
        assert await status(http) == before
        # The same bodies with the token do change it (the check above could fail).
        ok = await http.post(f"{P}/prepare", content=body(valid[f"{P}/prepare"]), headers=AUTH)
        assert ok.status_code == 200 and (await status(http))["phase"] == "prepared"


async def test_commit_and_restore_naming_a_path_outside_the_snapshot_root_are_refused(
    tmp_path: Path,
) -> None:
    """422, nothing written or read there, the checkpoint still open; inside, the same
    commit goes through. A symlink inside the root that points out of it is outside."""
    root, outside = tmp_path / "snapshots", tmp_path / "elsewhere"
    root.mkdir()
    (root / "escape").symlink_to(outside, target_is_directory=True)
    part = Participant("gated-0", Gated(), snapshot_root=root)
    async with serving(part) as http:
        ck = wire.PrepareRequest(checkpoint_id="ck1", deadline_ts=later())
        assert (await http.post(f"{P}/prepare", content=body(ck), headers=AUTH)).is_success
        for dest in (outside, root / "escape" / "envs", root / ".." / "elsewhere"):
            commit = wire.CommitRequest(checkpoint_id="ck1", scope=(), dest=str(dest))
            refused = await http.post(f"{P}/commit", content=body(commit), headers=AUTH)
            assert refused.status_code == 422, refused.text
            assert "outside this server's snapshot root" in refused.json()["detail"]
        assert not outside.exists() and (await status(http))["phase"] == "prepared"
        commit = wire.CommitRequest(checkpoint_id="ck1", scope=(), dest=str(root / "ck1"))
        assert (await http.post(f"{P}/commit", content=body(commit), headers=AUTH)).is_success
        resume = wire.ResumeRequest(checkpoint_id="ck1")
        assert (await http.post(f"{P}/resume", content=body(resume), headers=AUTH)).is_success
        restore = wire.RestoreRequest(
            restore_id="r1",
            source_checkpoint_id="ck1",
            root=str(outside),
            scope=(),
            deadline_ts=later(),
        )
        refused = await http.post(f"{P}/restore", content=body(restore), headers=AUTH)
        assert refused.status_code == 422 and (await status(http))["phase"] == "idle"


async def test_malformed_bodies_name_the_field(tmp_path: Path) -> None:
    cases = [
        (f"{P}/prepare", {"checkpoint_id": "ck1"}, "deadline_ts"),
        (f"{P}/prepare", {"checkpoint_id": "../x", "deadline_ts": 1.0}, "checkpoint_id"),
        (
            f"{P}/commit",
            {"checkpoint_id": "ck1", "scope": [{"rollout_id": "x"}], "dest": "/d"},
            "scope.0.rollout_id",
        ),
        (f"{P}/resume", {"checkpoint_id": "ck1", "surprise": 1}, "surprise"),
        (f"{P}/retire", {"rollouts": []}, "rollouts"),
        (wire.EPISODES_RUN, {"episode": {"rollout_id": "run-0_g0", "attempt": -1}}, "attempt"),
    ]
    async with serving(Participant("gated-0", Gated())) as http:
        before = await status(http)
        for path, payload, field in cases:
            answer = await http.post(path, content=json.dumps(payload), headers=AUTH)
            assert answer.status_code == 422, (path, answer.text)
            error = wire.ErrorReply.model_validate_json(answer.content)
            assert error.error == "InvalidInput" and field in error.detail, error.detail
        answer = await http.post(f"{P}/resume", content=b"{not json", headers=AUTH)
        assert answer.status_code == 422 and "<body>" in answer.json()["detail"]
        assert await status(http) == before


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)
)


def _nested(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)


_json = st.recursive(_scalars, _nested, max_leaves=8)
_near = st.sampled_from(
    ["ck1", "run-0_g0", "/tmp", 0, 1.5, 2e9, -1, [], {}, [{"rollout_id": "run-0_g0", "attempt": 0}]]
)
_keys = st.sampled_from(
    sorted({name for model in BODIES.values() for name in model.model_fields} | {"x", "attempt"})
)
_bodies = st.one_of(
    st.binary(max_size=32),
    _json.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(_keys, _json | _near, max_size=5).map(lambda v: json.dumps(v).encode()),
)


def _valid(model: type[BaseModel], content: bytes) -> bool:
    try:
        model.model_validate_json(content)
    except ValidationError:
        return False
    return True


def test_fuzzed_bodies_never_500_nor_change_state() -> None:
    """Bodies the protocol refuses: always a 422 ErrorReply, and status() never moves."""
    part = Participant("gated-0", Gated())
    with asyncio.Runner() as runner:
        transport = httpx.ASGITransport(app=participant_app(part, TOKEN))
        http = httpx.AsyncClient(transport=transport, base_url="http://participant", headers=AUTH)
        before = part.status()

        @settings(
            max_examples=50, deadline=None, suppress_health_check=[HealthCheck.filter_too_much]
        )
        @given(path=st.sampled_from(sorted(BODIES)), content=_bodies)
        def check(path: str, content: bytes) -> None:
            assume(not _valid(BODIES[path], content))  # a valid body may rightly change state
            answer = runner.run(http.post(path, content=content))
            assert answer.status_code == 422, answer.text
            assert wire.ErrorReply.model_validate_json(answer.content).error == "InvalidInput"
            assert part.status() == before

        try:
            check()
        finally:
            runner.run(http.aclose())
