"""The tool proxy: the gateway's front for an HTTP tool server (a NeMo Gym resources server:
``/seed_session``, ``POST /{tool}``, ``/verify``), so every tool call of a session is recorded
and made exactly once into the tool session its episode is scored in (docs/gateway.md, "Tools
exactly once").

The agent talks to the proxy as it would to the tool server: at the root of a port of its own
(NeMo Gym's config names a server by host and port only). A call's session is the
``rollsafe_session`` cookie the gateway handed the agent with the episode (or the
``X-Rollsafe-Session`` header); the tool server's own session cookies never leave the proxy:
it keeps them per session, so a restored episode's replayed ``/seed_session`` opens a fresh
tool session, and a superseded attempt, whose session has ended, reaches nothing.
"""

from __future__ import annotations

from http.cookiejar import CookieJar, DefaultCookiePolicy
from http.cookies import SimpleCookie

import httpx

from rollsafe.http.served import CLIENT_KEEPALIVE_S

SESSION_COOKIE = "rollsafe_session"
SESSION_HEADER = "x-rollsafe-session"
# Headers of the tool server's reply that do not describe the body the proxy sends on.
_HOP = {"content-length", "transfer-encoding", "connection", "set-cookie", "content-encoding"}


class ToolServer:
    """One upstream tool server: forwards a session's calls with that session's cookies."""

    def __init__(
        self, name: str, url: str, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.name, self.url = name, url.rstrip("/")
        # No read timeout: a tool may run long (nemo_gym's own client has none either). A
        # cookie jar that keeps nothing: sessions' cookies are kept apart, in self._jars.
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(None, connect=5.0),
            transport=transport,
            cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
            limits=httpx.Limits(max_connections=None, keepalive_expiry=CLIENT_KEEPALIVE_S),
        )
        self._jars: dict[str, dict[str, str]] = {}  # session -> the tool server's cookies

    async def forward(
        self, session: str, method: str, path: str, body: bytes, content_type: str
    ) -> tuple[int, str, str]:
        """(status, content type, reply text) of the call made upstream in ``session``'s tool
        session. A tool server that cannot be reached answers 502 naming it: the agent gets
        that as the tool's reply (as a failed call would), and the record holds it."""
        jar = self._jars.setdefault(session, {})
        headers = {"content-type": content_type} if content_type else {}
        if jar:
            headers["cookie"] = "; ".join(f"{name}={value}" for name, value in jar.items())
        try:
            reply = await self._http.request(method, path, content=body, headers=headers)
        except httpx.TransportError as exc:
            return (
                502,
                "application/json",
                f'{{"error": "tool server {self.name} unreachable: {type(exc).__name__}"}}',
            )
        for header in reply.headers.get_list("set-cookie"):
            jar.update({name: morsel.value for name, morsel in SimpleCookie(header).items()})
        return reply.status_code, reply.headers.get("content-type", ""), reply.text

    def forget(self, session: str) -> None:
        self._jars.pop(session, None)

    async def aclose(self) -> None:
        await self._http.aclose()
