"""The one way rollsafe's clients reach its servers (an engine, an environment instance): one
``httpx.AsyncClient`` built the same way everywhere, carrying the caller's trace context."""

from __future__ import annotations

import httpx

from rollsafe.http.contract import HEADERS, check_response
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
    span joins the caller's trace (:mod:`rollsafe.http.tracing`), and this release's contract:
    a server one too many releases apart is VersionSkew at the first answer
    (:mod:`rollsafe.http.contract`)."""
    headers = dict(HEADERS)
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers=headers,
        timeout=timeout,
        transport=transport,
        event_hooks={"request": [inject_trace_context], "response": [check_response]},
        limits=httpx.Limits(
            max_connections=None,
            max_keepalive_connections=64,
            keepalive_expiry=CLIENT_KEEPALIVE_S,
        ),
    )
