"""The engine HTTP app and client without a server process: a scripted engine behind
``httpx.ASGITransport`` (which buffers a streaming response: fine for statuses and errors)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Sequence

import httpx
import pytest
from typer.testing import CliRunner

from rollsafe.cli.app import app as cli
from rollsafe.engine.http import EngineClient, engine_app
from rollsafe.engine.protocol import (
    CutReport,
    EngineInfo,
    FinishEvent,
    GenerateRequest,
    PrefixRecord,
    SamplingParams,
    StreamEvent,
    TokenEvent,
    prompt_digest,
    seal_prefix,
)
from rollsafe.errors import (
    EngineUnavailable,
    InvalidInput,
    PrefixMismatch,
    RollsafeError,
    SealConflict,
)

TOKEN = "unit-token"
REQUEST = GenerateRequest(call_id="c1", prompt_tokens=(1, 2), sampling=SamplingParams(seed=1))


def token(index: int) -> TokenEvent:
    return TokenEvent(call_id="c1", index=index, token=10 + index, logprob=-0.5, weight_version=0)


class ScriptedEngine:
    """Yields ``events``, sleeping ``pause`` before each after the first; raises ``error``
    after ``error_after`` events (0: before any)."""

    def __init__(
        self,
        events: Sequence[StreamEvent] = (),
        *,
        error: Exception | None = None,
        error_after: int = 0,
        pause: float = 0.0,
    ) -> None:
        self.events = list(events)
        self.error = error
        self.error_after = error_after
        self.pause = pause
        self.cuts: list[tuple[tuple[str, ...], int]] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        for index, event in enumerate(self.events):
            if self.error is not None and index == self.error_after:
                raise self.error
            if index:
                await asyncio.sleep(self.pause)
            yield event
        if self.error is not None and self.error_after >= len(self.events):
            raise self.error

    def resume(self, request: GenerateRequest, prefix: PrefixRecord) -> AsyncIterator[StreamEvent]:
        return self.generate(request)

    async def cut(self, call_ids: Sequence[str], *, batch_size: int = 64) -> CutReport:
        self.cuts.append((tuple(call_ids), batch_size))
        return CutReport(prefixes=(), refused=(), handoffs=1)

    async def release(self, call_ids: Sequence[str]) -> int:
        return len(call_ids)

    async def info(self) -> EngineInfo:
        return EngineInfo(
            model="a" * 64, kind="dense", weight_version=0, active=0, frozen=0, handoffs=0
        )


def client_for(engine: ScriptedEngine, key: str = TOKEN, heartbeat_s: float = 10.0) -> EngineClient:
    transport = httpx.ASGITransport(app=engine_app(engine, TOKEN, heartbeat_s=heartbeat_s))
    return EngineClient("http://engine.test", key, transport=transport)


def raw_for(engine: ScriptedEngine, heartbeat_s: float = 10.0) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=engine_app(engine, TOKEN, heartbeat_s=heartbeat_s))
    headers = {"authorization": f"Bearer {TOKEN}"}
    return httpx.AsyncClient(transport=transport, base_url="http://engine.test", headers=headers)


async def collect(stream: AsyncIterator[StreamEvent]) -> list[StreamEvent]:
    return [event async for event in stream]


async def collect_into(stream: AsyncIterator[StreamEvent], got: list[StreamEvent]) -> None:
    """Append each event to ``got`` as it comes, so a caller sees what arrived before a raise."""
    async for event in stream:
        got.append(event)


FINISH = FinishEvent(call_id="c1", reason="length", n_tokens=2)


async def test_a_stream_round_trips() -> None:
    events: list[StreamEvent] = [token(0), token(1), FINISH]
    async with client_for(ScriptedEngine(events)) as client:
        assert await collect(client.generate(REQUEST)) == events
        assert await client.release(["a", "b"]) == 2
        assert (await client.info()).kind == "dense"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (PrefixMismatch("c1", "digest", "record says x"), 409),
        (InvalidInput("call 'c1' is already in flight"), 422),
        (EngineUnavailable("engine is closed"), 503),
        (SealConflict("not an engine error, still typed"), 500),
    ],
)
async def test_admission_errors_are_status_codes_and_come_back_typed(
    error: RollsafeError, status: int
) -> None:
    engine = ScriptedEngine([token(0), FINISH], error=error)
    async with raw_for(engine) as raw:
        response = await raw.post("/v1/generate", content=REQUEST.model_dump_json())
    assert response.status_code == status
    assert response.json()["error"] == type(error).__name__
    assert response.json()["detail"] == str(error)
    async with client_for(engine) as client:
        with pytest.raises(type(error)) as caught:
            await collect(client.generate(REQUEST))
    assert type(caught.value) is type(error) and str(caught.value) == str(error)
    if isinstance(error, PrefixMismatch):
        assert isinstance(caught.value, PrefixMismatch)
        assert (caught.value.call_id, caught.value.field) == ("c1", "digest")


async def test_an_untyped_engine_failure_is_a_500_and_engine_unavailable() -> None:
    engine = ScriptedEngine([token(0)], error=RuntimeError("kaboom"))
    async with client_for(engine) as client:
        with pytest.raises(EngineUnavailable, match=r"500 RuntimeError.*kaboom"):
            await collect(client.resume(REQUEST, _prefix()))


async def test_an_error_after_the_stream_started_is_a_final_line() -> None:
    engine = ScriptedEngine(
        [token(0), token(1), FINISH], error=EngineUnavailable("gone"), error_after=2
    )
    async with raw_for(engine) as raw:
        response = await raw.post("/v1/generate", content=REQUEST.model_dump_json())
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-ndjson"
    lines = response.text.splitlines()
    assert len(lines) == 3
    assert lines[-1] == '{"kind":"error","error":"EngineUnavailable","detail":"gone"}'
    got: list[StreamEvent] = []
    async with client_for(engine) as client:
        with pytest.raises(EngineUnavailable, match="gone"):
            await collect_into(client.generate(REQUEST), got)
    assert got == [token(0), token(1)]


async def test_a_prefix_mismatch_line_keeps_what_it_names() -> None:
    error = PrefixMismatch("c1", "model", "record is for another model")
    async with client_for(ScriptedEngine([token(0), FINISH], error=error, error_after=1)) as client:
        with pytest.raises(PrefixMismatch) as caught:
            await collect(client.generate(REQUEST))
    assert (caught.value.call_id, caught.value.field, str(caught.value)) == (
        "c1",
        "model",
        str(error),
    )


async def test_a_quiet_stream_gets_heartbeats_the_client_skips() -> None:
    events: list[StreamEvent] = [token(0), token(1), FINISH]
    engine = ScriptedEngine(events, pause=0.05)
    async with raw_for(engine, heartbeat_s=0.01) as raw:
        response = await raw.post("/v1/generate", content=REQUEST.model_dump_json())
    assert "" in response.text.splitlines()
    async with client_for(engine, heartbeat_s=0.01) as client:
        assert await collect(client.generate(REQUEST)) == events


async def test_a_stream_without_a_finish_is_engine_unavailable() -> None:
    async with client_for(ScriptedEngine([token(0), token(1)])) as client:
        with pytest.raises(EngineUnavailable, match="ended before a finish"):
            await collect(client.generate(REQUEST))
    async with client_for(ScriptedEngine([])) as client:
        with pytest.raises(EngineUnavailable, match="before any event"):
            await collect(client.generate(REQUEST))


async def test_auth_and_body_validation() -> None:
    engine = ScriptedEngine([FINISH])
    async with client_for(engine, key="wrong") as client:
        with pytest.raises(InvalidInput, match="refused the token"):
            await client.info()
    async with raw_for(engine) as raw:
        assert (await raw.get("/v1/health", headers={"authorization": ""})).json() == {"ok": True}
        response = await raw.post("/v1/cut", json={"call_ids": ["a"], "batch_size": 0})
        assert response.status_code == 422
        assert response.json()["error"] == "InvalidInput"
        assert "batch_size" in response.json()["detail"]
        response = await raw.post("/v1/resume", json={"request": REQUEST.model_dump()})
        assert response.status_code == 422
        assert "prefix" in response.json()["detail"]


async def test_cut_passes_batch_size_to_an_engine_that_takes_it() -> None:
    engine = ScriptedEngine()
    async with client_for(engine) as client:
        await client.cut(["a", "b"])
        await client.cut(["c"], batch_size=1)
    assert engine.cuts == [(("a", "b"), 64), (("c",), 1)]


async def test_an_unreachable_engine_is_engine_unavailable_naming_the_url() -> None:
    with socket.socket() as probe:  # a port nobody listens on once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    async with EngineClient(url, TOKEN, connect_timeout=2) as client:
        with pytest.raises(EngineUnavailable, match=url):
            await client.info()
        with pytest.raises(EngineUnavailable, match=url):
            await collect(client.generate(REQUEST))


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ([], {"ROLLSAFE_ENGINE_TOKEN": " "}, "must not be empty"),
        ([], {"ROLLSAFE_ENGINE_TOKEN": ""}, "token"),
        (["--model", "huge"], {"ROLLSAFE_ENGINE_TOKEN": "t"}, "dense or moe"),
    ],
)
def test_engine_serve_refuses_bad_arguments(
    args: list[str], env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ROLLSAFE_ENGINE_TOKEN", raising=False)
    result = CliRunner().invoke(cli, ["engine", "serve", "--port", "0", *args], env=env)
    assert result.exit_code == 2
    assert message in result.output


def _prefix() -> PrefixRecord:
    return seal_prefix(
        call_id="c1",
        model="a" * 64,
        prompt_digest=prompt_digest(REQUEST.prompt_tokens),
        sampling=REQUEST.sampling,
        tokens=(10,),
        logprobs=(-0.5,),
        weight_versions=(0,),
    )
