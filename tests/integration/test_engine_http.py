"""The engine over HTTP, against a real ``rollsafe engine serve`` process (MoE, seed 3).

The same seed builds the same weights in another process, so every remote completion must
equal the in-process :class:`TorchEngine`'s bit for bit, cut and resumed or not.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollsafe.engine.http import EngineClient
from rollsafe.engine.loop import HOLD_ENV, HoldRule
from rollsafe.engine.model import ModelConfig
from rollsafe.engine.protocol import (
    Completion,
    Engine,
    GenerateRequest,
    PrefixRecord,
    SamplingParams,
    StreamEvent,
    completion_of,
)
from rollsafe.engine.torch_engine import TorchEngine
from rollsafe.errors import EngineUnavailable, InvalidInput, PrefixMismatch
from rollsafe.http.served import ENGINE_BANNER, ServedProcess, start_served
from rollsafe.testing.parity import completed
from rollsafe.testing.waiting import eventually, eventually_async

TOKEN = "engine-test-token"
SEED = 3
MAX_TOKENS = 24
LIMIT_S = 30
BANNER = ENGINE_BANNER.format(kind="moe")
# The calls start_and_cut makes stop after their first token until their cut, so a cut always
# catches them mid-generation; each cut ends the hold for the calls it froze only.
HELD = HoldRule(calls=r"^held-", once=False)


def _start_server(logs: Path) -> ServedProcess:
    """Start `rollsafe engine serve` on a free port (the OS picks; the banner names it)."""
    args = ["engine", "serve", "--port", "0", "--model", "moe", "--seed", str(SEED)]
    # The env route: no token in argv.
    env = {"ROLLSAFE_ENGINE_TOKEN": TOKEN, HOLD_ENV: HELD.model_dump_json()}
    server = start_served(args, BANNER, logs, env=env)
    try:
        eventually(
            lambda: httpx.get(f"{server.url}/v1/health").json() == {"ok": True},
            what=f"{server.url}/v1/health answering ok",
        )
    except BaseException:
        server.stop()
        raise
    return server


def bounded(test: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """Fail instead of hanging: a frozen call heartbeats, so a lost release waits forever."""

    @functools.wraps(test)
    async def run_bounded(*args: Any, **kwargs: Any) -> None:
        async with asyncio.timeout(LIMIT_S):
            await test(*args, **kwargs)

    return run_bounded


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = _start_server(tmp_path_factory.mktemp("engine-server"))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
async def client(server: str) -> AsyncIterator[EngineClient]:
    async with EngineClient(server, TOKEN, timeout=30) as remote:
        yield remote


def requests(n: int, max_tokens: int = MAX_TOKENS, held: bool = False) -> list[GenerateRequest]:
    # Call ids are unique per test: the server is shared by the whole module.
    tag = ("held-" if held else "") + uuid.uuid4().hex[:8]
    return [
        GenerateRequest(
            call_id=f"{tag}-{i}",
            prompt_tokens=(7 + i, 40, 301, 2 * i),
            sampling=SamplingParams(
                seed=1000 + i, temperature=0.7 + 0.1 * i, max_tokens=max_tokens
            ),
        )
        for i in range(n)
    ]


def local_engine() -> TorchEngine:
    return TorchEngine(ModelConfig(kind="moe"), seed=SEED)


def held_local_engine() -> TorchEngine:
    """An in-process engine that holds HELD's calls (an engine reads its hold when built)."""
    os.environ[HOLD_ENV] = HELD.model_dump_json()
    try:
        return local_engine()
    finally:
        del os.environ[HOLD_ENV]


async def uninterrupted(reqs: Sequence[GenerateRequest]) -> list[Completion]:
    async with local_engine() as engine:
        return list(await asyncio.gather(*(completed(engine, r) for r in reqs)))


@dataclass
class Cut:
    requests: list[GenerateRequest]
    streams: list[AsyncIterator[StreamEvent]]
    firsts: list[StreamEvent]
    prefixes: dict[str, PrefixRecord]


async def start_and_cut(engine: Engine, n: int) -> Cut:
    """Start n calls, wait for each one's first token, cut them all mid-generation (held by
    the engine since that token, they cannot have finished)."""
    reqs = requests(n, held=True)
    streams = [engine.generate(r) for r in reqs]
    firsts = list(await asyncio.gather(*(anext(s) for s in streams)))
    report = await engine.cut([r.call_id for r in reqs])
    assert not report.refused, report.refused
    prefixes = {p.call_id: p for p in report.prefixes}
    assert sorted(prefixes) == sorted(r.call_id for r in reqs)
    for prefix in prefixes.values():
        assert 1 <= len(prefix.tokens) < MAX_TOKENS  # really mid-generation
    return Cut(reqs, streams, firsts, prefixes)


async def close_all(streams: Sequence[AsyncIterator[StreamEvent]]) -> None:
    for stream in streams:
        await stream.aclose()  # type: ignore[attr-defined]


@bounded
async def test_remote_completions_equal_in_process(client: EngineClient) -> None:
    assert isinstance(client, Engine)
    reqs = requests(4)
    remote = await asyncio.gather(*(completed(client, r) for r in reqs))
    assert remote == await uninterrupted(reqs)
    assert all(c.routes is not None and len(c.routes) == MAX_TOKENS for c in remote)
    info = await client.info()
    assert (info.kind, info.model) == ("moe", ModelConfig(kind="moe").fingerprint())


@bounded
async def test_cut_over_http_resumes_in_process(client: EngineClient) -> None:
    cut = await start_and_cut(client, 8)
    await close_all(cut.streams)
    async with local_engine() as engine:
        again = [await completed(engine, r, cut.prefixes[r.call_id]) for r in cut.requests]
    assert again == await uninterrupted(cut.requests)


@bounded
async def test_cut_in_process_resumes_over_http(client: EngineClient) -> None:
    async with held_local_engine() as engine:
        cut = await start_and_cut(engine, 4)
        await close_all(cut.streams)
    prefixes, reqs = cut.prefixes, cut.requests
    again = await asyncio.gather(*(completed(client, r, prefixes[r.call_id]) for r in reqs))
    assert again == await uninterrupted(reqs)


@bounded
async def test_abandoned_stream_frees_its_call_for_resume_on_the_same_server(
    client: EngineClient,
) -> None:
    cut = await start_and_cut(client, 3)
    await close_all(cut.streams)  # the server sees the disconnect and drops the frozen calls

    async def dropped() -> bool:
        info = await client.info()
        return not (info.frozen or info.active)

    await eventually_async(dropped, 10, what="the server dropped the abandoned calls")
    prefixes, reqs = cut.prefixes, cut.requests
    again = await asyncio.gather(*(completed(client, r, prefixes[r.call_id]) for r in reqs))
    assert again == await uninterrupted(reqs)


@bounded
async def test_release_over_http_lets_frozen_calls_finish(client: EngineClient) -> None:
    cut = await start_and_cut(client, 8)
    ids = [r.call_id for r in cut.requests]
    seen: list[list[StreamEvent]] = [[first] for first in cut.firsts]
    for call_id, stream, events in zip(ids, cut.streams, seen, strict=True):
        while len(events) < len(cut.prefixes[call_id].tokens):
            events.append(await anext(stream))  # tokens made before the cut, in transit
    assert (await client.info()).frozen == 8
    nexts = [asyncio.ensure_future(anext(s)) for s in cut.streams]
    done, _ = await asyncio.wait(nexts, timeout=0.3)
    assert not done, "a frozen call went on generating"
    assert await client.release(ids) == 8
    for stream, events, pending in zip(cut.streams, seen, nexts, strict=True):
        events.append(await pending)
        events.extend([e async for e in stream])
    finished = [completion_of(call_id, events) for call_id, events in zip(ids, seen, strict=True)]
    assert finished == await uninterrupted(cut.requests)
    assert await client.release(ids) == 0  # finished: nothing left frozen


@bounded
async def test_wrong_token_is_refused(server: str) -> None:
    async with httpx.AsyncClient(base_url=server) as raw:
        assert (await raw.get("/v1/health")).json() == {"ok": True}  # no token needed
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": TOKEN}):
            response = await raw.get("/v1/info", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"] == "Unauthorized"
    async with EngineClient(server, "nope") as wrong:
        with pytest.raises(InvalidInput, match="refused the token"):
            await wrong.info()
        with pytest.raises(InvalidInput, match="refused the token"):
            await completed(wrong, requests(1)[0])


@bounded
async def test_malformed_body_is_422_naming_the_field(server: str) -> None:
    headers = {"authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=server, headers=headers) as raw:
        body = {"call_id": "x", "prompt_tokens": [1, 2]}  # no sampling
        response = await raw.post("/v1/generate", json=body)
        assert response.status_code == 422
        assert response.json()["error"] == "InvalidInput"
        assert "sampling" in response.json()["detail"]
        response = await raw.post("/v1/cut", json={"call_ids": ["x"], "batch": 3})
        assert response.status_code == 422
        assert "batch" in response.json()["detail"]
        response = await raw.post("/v1/release", content=b"{not json")
        assert response.status_code == 422


@bounded
async def test_tampered_or_foreign_prefix_raises_prefix_mismatch(client: EngineClient) -> None:
    async with held_local_engine() as engine:
        cut = await start_and_cut(engine, 1)
        await close_all(cut.streams)
    (request,), (prefix,) = cut.requests, cut.prefixes.values()
    tampered = prefix.model_copy(
        update={"tokens": ((prefix.tokens[0] + 1) % 512, *prefix.tokens[1:])}
    )
    with pytest.raises(PrefixMismatch, match="digest") as caught:
        await completed(client, request, tampered)
    assert (caught.value.call_id, caught.value.field) == (tampered.call_id, "digest")
    other = request.model_copy(update={"call_id": request.call_id + "-other"})
    with pytest.raises(PrefixMismatch, match="call_id"):
        await completed(client, other, prefix)  # a sound record, for another call
    async with httpx.AsyncClient(base_url=client.base_url) as raw:
        body = {"request": request.model_dump(), "prefix": tampered.model_dump()}
        response = await raw.post(
            "/v1/resume", json=body, headers={"authorization": f"Bearer {TOKEN}"}
        )
    assert response.status_code == 409
    assert response.json()["error"] == "PrefixMismatch"


@bounded
async def test_duplicate_call_id_and_bad_prompt_are_invalid_input(client: EngineClient) -> None:
    cut = await start_and_cut(client, 1)  # frozen: surely still in flight
    (request,) = cut.requests
    with pytest.raises(InvalidInput, match="already in flight"):
        await completed(client, request)
    await close_all(cut.streams)
    bad = request.model_copy(update={"call_id": request.call_id + "-bad", "prompt_tokens": (9999,)})
    with pytest.raises(InvalidInput, match="outside"):
        await completed(client, bad)


@bounded
async def test_sigterm_closes_the_engine_and_ends_streams(tmp_path: Path) -> None:
    server = _start_server(tmp_path / "logs")
    proc = server.proc
    try:
        async with EngineClient(server.url, TOKEN, timeout=30) as remote:
            cut = await start_and_cut(remote, 1)  # a frozen call would hold a lax shutdown open
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(EngineUnavailable, match="engine closed"):
                async for _ in cut.streams[0]:
                    pass
        assert await asyncio.to_thread(proc.wait, 15) in (0, -signal.SIGTERM)
        assert "Finished server process" in server.err.read_text()
    finally:
        server.stop()


@bounded
async def test_new_weights_over_http_serve_the_same_tokens_as_in_process(tmp_path: Path) -> None:
    """A trainer's push: the server then generates exactly what an in-process engine with the
    same weights generates, tagged with the new version; stale or malformed uploads change
    nothing. Its own server: the module's shared one must keep its seed's weights."""
    import torch

    server = await asyncio.to_thread(_start_server, tmp_path)
    try:
        async with EngineClient(server.url, TOKEN, timeout=30) as remote, local_engine() as local:
            generator = torch.Generator().manual_seed(7)
            trained = {
                name: value + 0.05 * torch.randn(value.shape, generator=generator)
                for name, value in local.model.state_dict().items()
            }
            before = await completed(remote, requests(1)[0])
            await remote.update_weights(trained, 1)
            await local.update_weights(trained, 1)
            assert (await remote.info()).weight_version == 1
            reqs = requests(3)
            here = [await completed(local, r) for r in reqs]
            there = [await completed(remote, r) for r in reqs]
            assert [c.tokens for c in there] == [c.tokens for c in here]
            assert [c.logprobs for c in there] == [c.logprobs for c in here]
            assert all(set(c.weight_versions) == {1} for c in there)
            assert before.tokens != there[0].tokens or before.logprobs != there[0].logprobs
            with pytest.raises(InvalidInput, match="not newer"):
                await remote.update_weights(trained, 1)
            response = await remote._http.post(
                "/v1/weights", params={"version": 2}, content=b"not safetensors"
            )
            assert response.status_code == 422
            assert (await remote.info()).weight_version == 1
    finally:
        server.stop()
