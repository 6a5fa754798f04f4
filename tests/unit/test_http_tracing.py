"""Trace context across rollsafe's HTTP calls, in process (httpx.ASGITransport, an in-memory
span exporter): the client builder sends the current context, the engine and environment apps
open a server span as its child, and without tracing nothing is sent, opened or broken."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollsafe.engine.http import EngineClient, engine_app
from rollsafe.engine.protocol import EngineInfo
from rollsafe.env.client import EnvClient
from rollsafe.env.participant import Participant
from rollsafe.env.router import participant_app
from rollsafe.http.client import http_client
from rollsafe.http.tracing import ServerSpans
from rollsafe.testing.envs import Idle

TOKEN = "unit-token"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    found = InMemorySpanExporter()
    yield found
    found.clear()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    made = TracerProvider()
    made.add_span_processor(SimpleSpanProcessor(exporter))
    return made


@pytest.fixture
def configured(monkeypatch: pytest.MonkeyPatch, provider: TracerProvider) -> TracerProvider:
    """Tracing configured for the servers (their middleware reads the global provider at each
    request): the test's provider stands in for the one configure_tracing installs."""
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    return provider


@pytest.fixture
def unconfigured(monkeypatch: pytest.MonkeyPatch) -> None:
    """No tracing configured, as in a process where OTEL_TRACES_EXPORTER is unset."""
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)


async def echo(request: Request) -> Response:
    """What the server saw: the traceparent header, and the span current in the handler."""
    span = trace.get_current_span().get_span_context()
    return JSONResponse(
        {
            "traceparent": request.headers.get("traceparent"),
            "trace_id": span.trace_id,
            "recording": trace.get_current_span().is_recording(),
        }
    )


async def failing(request: Request) -> Response:
    return Response("down", status_code=503)


def echo_app(provider: trace.TracerProvider | None = None) -> ServerSpans:
    routes = [Route("/echo", echo), Route("/failing", failing)]
    return ServerSpans(Starlette(routes=routes), tracer_provider=provider)


def client_of(app: Any) -> httpx.AsyncClient:
    return http_client("http://server", TOKEN, transport=httpx.ASGITransport(app=app))


def only(spans: tuple[ReadableSpan, ...], kind: SpanKind) -> ReadableSpan:
    [span] = [s for s in spans if s.kind == kind]
    return span


async def test_the_server_span_is_the_child_of_the_callers(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    async with client_of(echo_app(provider)) as client:
        with provider.get_tracer("test").start_as_current_span("phase", kind=SpanKind.CLIENT):
            reply = (await client.get("/echo")).json()
    spans = exporter.get_finished_spans()
    caller, server = only(spans, SpanKind.CLIENT), only(spans, SpanKind.SERVER)
    assert caller.context is not None and server.context is not None
    assert server.context.trace_id == caller.context.trace_id
    assert server.parent is not None and server.parent.span_id == caller.context.span_id
    assert server.name == "GET /echo"
    assert dict(server.attributes or {}) == {
        "http.request.method": "GET",
        "url.path": "/echo",
        "http.response.status_code": 200,
    }
    # The handler ran inside the server span; the header was the W3C one.
    assert reply["trace_id"] == caller.context.trace_id and reply["recording"] is True
    assert reply["traceparent"].startswith(f"00-{caller.context.trace_id:032x}-")


async def test_without_a_caller_span_the_server_span_is_a_root(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    async with client_of(echo_app(provider)) as client:
        reply = (await client.get("/echo")).json()
    server = only(exporter.get_finished_spans(), SpanKind.SERVER)
    assert reply["traceparent"] is None
    assert server.parent is None


async def test_a_5xx_marks_the_server_span_as_an_error(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    async with client_of(echo_app(provider)) as client:
        assert (await client.get("/failing")).status_code == 503
    server = only(exporter.get_finished_spans(), SpanKind.SERVER)
    assert server.status.status_code is StatusCode.ERROR
    assert (server.attributes or {})["http.response.status_code"] == 503


@pytest.mark.usefixtures("unconfigured")
async def test_no_tracing_no_span_no_header_no_error(exporter: InMemorySpanExporter) -> None:
    async with client_of(echo_app()) as client:
        response = await client.get("/echo", headers={"traceparent": "not-a-traceparent"})
        plain = (await client.get("/echo")).json()
    assert response.status_code == 200
    assert response.json()["recording"] is False
    assert plain == {"traceparent": None, "trace_id": 0, "recording": False}
    assert exporter.get_finished_spans() == ()


class Info:
    """Just enough of an engine for ``/v1/info``."""

    async def info(self) -> EngineInfo:
        return EngineInfo(
            model="0" * 64, kind="dense", weight_version=3, active=0, frozen=0, handoffs=0
        )


async def test_engine_and_environment_calls_join_the_callers_trace(
    configured: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """The real clients against the real apps: each call's server span is in the phase's
    trace (the client builder injects, the apps' middleware extracts)."""
    engine_transport = httpx.ASGITransport(app=engine_app(Info(), TOKEN))  # type: ignore[arg-type]
    env_app = participant_app(Participant("idle-0", Idle()), TOKEN)
    tracer = configured.get_tracer("test")
    async with (
        EngineClient("http://engine", TOKEN, transport=engine_transport) as engine,
        EnvClient("http://env", TOKEN, transport=httpx.ASGITransport(app=env_app)) as env,
    ):
        with tracer.start_as_current_span("rollsafe.phase.cut_generation") as phase:
            assert (await engine.info()).weight_version == 3
            assert (await env.status()).phase == "idle"
    servers = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert sorted(s.name for s in servers) == ["GET /checkpoint/v1/status", "GET /v1/info"]
    for server in servers:
        assert server.parent is not None
        assert server.parent.span_id == phase.get_span_context().span_id
        assert server.context is not None
        assert server.context.trace_id == phase.get_span_context().trace_id
