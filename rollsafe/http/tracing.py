"""Trace context across rollsafe's HTTP calls (controller -> environment -> engine).

Clients built by :func:`rollsafe.http.client.http_client` send the current trace context with
every request (W3C ``traceparent``, by OpenTelemetry's global propagator:
:func:`inject_trace_context`); the environment and engine servers wrap their app in
:class:`ServerSpans`, which opens a server span per request as the caller's child, so a
snapshot's phase span, the participants' checkpoint calls and the engines' cuts are one trace.

Without a configured tracer provider (``OTEL_TRACES_EXPORTER`` unset or ``none``) the
middleware passes requests through untouched and injecting writes no header: no span, no
cost beyond a type check.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]
TRACER = "rollsafe.http"


async def inject_trace_context(request: httpx.Request) -> None:
    """An httpx request hook: the current span's context into the request's headers."""
    propagate.inject(request.headers)


def tracing_on(provider: trace.TracerProvider) -> bool:
    """Whether spans of ``provider`` go anywhere: the API's placeholders record nothing."""
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


class ServerSpans:
    """ASGI middleware: one ``SpanKind.SERVER`` span per HTTP request, named ``METHOD
    /path``, the child of the trace context the request carries (a root span without one),
    with the method, path and response status; a 5xx marks it as an error. ``tracer_provider``:
    the global one by default (tests pass their own)."""

    def __init__(self, app: Asgi, tracer_provider: trace.TracerProvider | None = None) -> None:
        self.app = app
        self._provider = tracer_provider

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        provider = self._provider or trace.get_tracer_provider()
        if scope["type"] != "http" or not tracing_on(provider):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        method, path = scope["method"], scope["path"]
        tracer = trace.get_tracer(TRACER, tracer_provider=provider)
        with tracer.start_as_current_span(
            f"{method} {path}",
            # From the headers alone, never the context current here: a server in the
            # caller's process (tests, an embedded server) must not parent by accident.
            context=propagate.extract(headers, context=Context()),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        ) as span:

            async def send_noting_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
                await send(message)

            await self.app(scope, receive, send_noting_status)
