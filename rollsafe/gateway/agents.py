"""An episode's entry point: how the gateway starts (and, after a restore, starts again) the
agent that runs it (docs/gateway.md, "Agents").

- :class:`HttpAgent`: an agent server's endpoint taking the task as its JSON body, as NeMo
  Gym's agents take ``POST /run``. The session goes with the call three ways, so an agent
  needs no change to carry it: a ``rollsafe_session`` cookie (NeMo Gym's agents forward the
  run's cookies to the resources server, which is our tool proxy), an ``X-Rollsafe-Session``
  header, and ``metadata.rollsafe_session`` in the task's ``responses_create_params`` (which
  NeMo Gym's agents send on every model call).
- :class:`FunctionAgent`: a Python function ``agent(base_url, task) -> reward or dict`` run in
  the gateway's process; ``base_url`` is the session's own OpenAI base URL
  (``.../sessions/<session>/v1``), so an ``openai`` client pointed at it needs nothing else.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from rollsafe.errors import EnvUnavailable, InvalidInput
from rollsafe.gateway.tools import SESSION_COOKIE, SESSION_HEADER
from rollsafe.gateway.wire import SESSION_METADATA_KEY

# Keys of an agent's reply left out of the episode's info: they repeat the conversation, whose
# tokens the session's record holds already.
_BULKY = ("response", "responses_create_params")


@dataclass(frozen=True)
class AgentOutcome:
    reward: float
    info: dict[str, Any] = field(default_factory=dict)


class AgentEntry(Protocol):
    async def run(self, task: Mapping[str, Any], session: str) -> AgentOutcome: ...

    async def aclose(self) -> None: ...


def with_session(task: Mapping[str, Any], session: str) -> dict[str, Any]:
    """``task`` with the session in ``responses_create_params.metadata`` when it has one."""
    body = copy.deepcopy(dict(task))
    params = body.get("responses_create_params")
    if isinstance(params, dict):
        metadata = dict(params.get("metadata") or {})
        metadata[SESSION_METADATA_KEY] = session
        params["metadata"] = metadata
    return body


def outcome_of(reply: Any, where: str) -> AgentOutcome:
    """An agent's reply: a number (the reward) or an object with a numeric ``reward``."""
    if isinstance(reply, bool) or not isinstance(reply, int | float | dict):
        raise InvalidInput(f"{where}: expected a reward or an object with one, got {reply!r:.80}")
    if not isinstance(reply, dict):
        return AgentOutcome(reward=float(reply))
    reward = reply.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise InvalidInput(f"{where}: its reply has no numeric 'reward' (got {reward!r:.80})")
    return AgentOutcome(
        reward=float(reward), info={k: v for k, v in reply.items() if k not in _BULKY}
    )


class HttpAgent:
    def __init__(self, url: str, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url
        # No read timeout: an episode runs as long as it runs; a dead agent is a closed
        # connection, and a retired attempt cancels the call.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0), transport=transport
        )

    async def run(self, task: Mapping[str, Any], session: str) -> AgentOutcome:
        headers = {SESSION_HEADER: session, "cookie": f"{SESSION_COOKIE}={session}"}
        try:
            reply = await self._http.post(
                self.url, json=with_session(task, session), headers=headers
            )
        except httpx.TransportError as exc:
            raise EnvUnavailable(f"agent at {self.url} unreachable: {exc!r}") from exc
        if reply.status_code >= 500:
            raise EnvUnavailable(
                f"agent at {self.url} failed ({reply.status_code}): {reply.text[:300]}"
            )
        if reply.status_code != 200:
            raise InvalidInput(
                f"agent at {self.url} refused the task ({reply.status_code}): {reply.text[:300]}"
            )
        try:
            body = reply.json()
        except ValueError:
            raise InvalidInput(
                f"agent at {self.url} answered no JSON: {reply.text[:200]!r}"
            ) from None
        return outcome_of(body, f"agent at {self.url}")

    async def aclose(self) -> None:
        await self._http.aclose()


AgentFunction = Callable[[str, dict[str, Any]], Awaitable[Any] | Any]


class FunctionAgent:
    def __init__(self, function: AgentFunction, session_url: Callable[[str], str]) -> None:
        self.function, self.session_url = function, session_url
        self.name = getattr(function, "__qualname__", repr(function))

    async def run(self, task: Mapping[str, Any], session: str) -> AgentOutcome:
        reply = self.function(self.session_url(session), copy.deepcopy(dict(task)))
        if inspect.isawaitable(reply):
            reply = await reply
        return outcome_of(reply, f"agent {self.name}")

    async def aclose(self) -> None:
        return None
