"""The one way rollsafe's clients reach its servers (an engine, an environment instance): one
``httpx.AsyncClient`` built the same way everywhere."""

from __future__ import annotations

import httpx

from rollsafe.http.served import CLIENT_KEEPALIVE_S


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
    are dropped before the server drops them (``CLIENT_KEEPALIVE_S``)."""
    headers = {"authorization": f"Bearer {token}"} if token is not None else None
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers=headers,
        timeout=timeout,
        transport=transport,
        limits=httpx.Limits(
            max_connections=None,
            max_keepalive_connections=64,
            keepalive_expiry=CLIENT_KEEPALIVE_S,
        ),
    )
