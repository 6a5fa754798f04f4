"""The one way rollsafe's clients reach its servers (an engine, an environment instance): one
``httpx.AsyncClient`` built the same way everywhere, carrying the caller's trace context."""

from __future__ import annotations

import httpx

from rollsafe.http.served import CLIENT_KEEPALIVE_S
from rollsafe.http.tracing import inject_trace_context


def http_client(
    base_url: str,
    token: str | None,
    *,
    timeout: httpx.Timeout | float | None = 5.0,  # httpx's own default; calls may set theirs
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    """A client of the server at ``base_url`` sending ``token`` as its bearer token (None: the
    caller sets its own headers). No bound on connections: every call or episode in flight
    holds one, and a bounded pool would make the next wait for one, then time out. Idle ones
    are dropped before the server drops them (``CLIENT_KEEPALIVE_S``). Every request carries
    the current trace context (``traceparent``; none while no span is current): the server's
    span joins the caller's trace (:mod:`rollsafe.http.tracing`)."""
    headers = {"authorization": f"Bearer {token}"} if token is not None else None
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers=headers,
        timeout=timeout,
        transport=transport,
        event_hooks={"request": [inject_trace_context]},
        limits=httpx.Limits(
            max_connections=None,
            max_keepalive_connections=64,
            keepalive_expiry=CLIENT_KEEPALIVE_S,
        ),
    )
