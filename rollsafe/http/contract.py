"""The contract (rollsafe.versions) on rollsafe's HTTP protocols: the engine protocol, the
environment checkpoint protocol and the gateway.

Every request a client of :func:`rollsafe.http.client.http_client` sends, and every response a
server wrapped in :class:`ContractHeaders` sends, carries ``rollsafe-contract`` (and
``rollsafe-release``). Headers, not fields: a peer of a release before contracts ignores them,
so nothing it reads changes. Each side checks the other at every exchange (a header is free):

- the client, on every response that names a contract (:func:`check_response`, an httpx
  response hook): one too many releases apart is :class:`~rollsafe.errors.VersionSkew`, raised
  from the call, before its body is read;
- the server, on every request: one it does not work with is answered 409 ``VersionSkew``
  naming both sides, its handler never run. A request without the header is of a release
  before contracts (contract 1); health paths are answered whatever the caller (probes).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import httpx

from rollsafe.http.tracing import Asgi, Message, Receive, Scope, Send
from rollsafe.versions import THIS, Peer, check_peer, skew, unversioned_peer

CONTRACT_HEADER = "rollsafe-contract"
RELEASE_HEADER = "rollsafe-release"
HEADERS = {CONTRACT_HEADER: str(THIS.contract), RELEASE_HEADER: THIS.release}
_RAW_HEADERS = [(k.encode(), v.encode()) for k, v in HEADERS.items()]
HEALTH_PATHS = frozenset({"/v1/health", "/healthz", "/livez", "/health"})


def peer_of(headers: dict[str, str]) -> Peer:
    """The peer the headers name; none: a release before contracts. A contract that is not
    a number reads as 0: refused, named as it was sent."""
    raw = headers.get(CONTRACT_HEADER)
    if raw is None:
        return unversioned_peer()
    release = headers.get(RELEASE_HEADER, "?")
    contract = int(raw) if raw.isdigit() and int(raw) >= 1 else None
    if contract is None:
        return Peer.model_construct(release=f"{release} (contract {raw!r})", contract=0)
    return Peer(release=release, contract=contract)


async def check_response(response: httpx.Response) -> None:
    """An httpx response hook: VersionSkew when the server names a contract this release does
    not work with (a server that names none is let be: its body decides)."""
    if CONTRACT_HEADER not in response.headers:
        return
    url = response.request.url
    check_peer(
        f"the server at {url.scheme}://{url.netloc.decode()}", peer_of(dict(response.headers))
    )


class ContractHeaders:
    """ASGI middleware: this release's headers on every response; a request of a contract this
    release does not work with answered 409 ``VersionSkew`` (health paths exempt).
    ``strangers``: a request without the header is not rollsafe's (the gateway's OpenAI
    clients) and is served as it is, instead of being taken for a release before contracts."""

    def __init__(
        self, app: Asgi, exempt: Iterable[str] = HEALTH_PATHS, *, strangers: bool = False
    ) -> None:
        self.app = app
        self.exempt = frozenset(exempt)
        self.strangers = strangers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        stranger = self.strangers and CONTRACT_HEADER not in headers
        refusal = None if stranger else skew("the caller", peer_of(headers))
        if refusal is not None and scope["path"] not in self.exempt:
            await _refuse(refusal, send)
            return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_RAW_HEADERS]
            await send(message)

        await self.app(scope, receive, stamped)


async def _refuse(detail: str, send: Send) -> None:
    body = json.dumps({"error": "VersionSkew", "detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 409,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *_RAW_HEADERS,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
