"""An episode's entry point: how the gateway starts (and, after a restore, starts again) the
agent that runs it (docs/gateway.md, "Agents").

- :class:`HttpAgent`: an agent server's endpoint taking the task as its JSON body, as NeMo
  Gym's agents take ``POST /run`` (``protocol="run"``), or NeMo Gym 0.7's typed episode
  protocol (``protocol="episode"``: its environment servers' ``/run``, e.g. single_agent_turn:
  ``{episode_id: {rollout_id, attempt}, task: {task_id, task_input}}`` in, ``{result}`` or
  ``{failure}`` out). The session goes with the call three ways, so an agent needs no change to
  carry it: a ``rollsafe_session`` cookie (NeMo Gym's agents forward the run's cookies to the
  resources server, which is our tool proxy), an ``X-Rollsafe-Session`` header, and
  ``metadata.rollsafe_session`` in the task's ``responses_create_params`` (which NeMo Gym's
  agents send on every model call). An environment server that seeds the resources session
  itself sends none of them: its seed names the episode (``episode_id``), which the proxy maps
  to the session (:meth:`rollsafe.gateway.hooks.GatewayHooks.session_of_episode`).
- :class:`FunctionAgent`: a Python function ``agent(base_url, task) -> reward or dict`` run in
  the gateway's process; ``base_url`` is the session's own OpenAI base URL
  (``.../sessions/<session>/v1``), so an ``openai`` client pointed at it needs nothing else.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx

from rollsafe.env.protocol import EpisodeRef
from rollsafe.errors import EnvUnavailable, InvalidInput
from rollsafe.gateway.tools import SESSION_COOKIE, SESSION_HEADER
from rollsafe.gateway.wire import SESSION_METADATA_KEY

AgentProtocol = Literal["run", "episode"]
TASKSET = "rollsafe"  # the taskset an episode protocol's task ids are named in

# Keys of an agent's reply left out of the episode's info: they repeat the conversation, whose
# tokens the session's record holds already.
_BULKY = ("response", "responses_create_params")


@dataclass(frozen=True)
class AgentOutcome:
    reward: float
    info: dict[str, Any] = field(default_factory=dict)


class AgentEntry(Protocol):
    async def run(
        self, task: Mapping[str, Any], session: str, episode: EpisodeRef
    ) -> AgentOutcome: ...

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


def episode_request(task: Mapping[str, Any], session: str, episode: EpisodeRef) -> dict[str, Any]:
    """The typed episode request for ``task`` (NeMo Gym 0.7's ``BaseEpisodeRequest``): the
    episode's rollout and attempt as its ``episode_id``, the task (a flat dataset row, which
    its task input accepts) under a task id made from its content, the same for every attempt."""
    row = with_session(task, session)
    digest = hashlib.sha256(json.dumps(dict(task), sort_keys=True).encode()).hexdigest()[:24]
    return {
        "episode_id": {"rollout_id": episode.rollout_id, "attempt": episode.attempt},
        "task": {"task_id": {"taskset": TASKSET, "task_id": digest}, "task_input": row},
    }


def episode_outcome(reply: Any, where: str) -> AgentOutcome:
    """An episode protocol's reply: its ``result`` (a verify response: ``reward`` and the
    rest), or its ``failure`` raised (not terminal: :class:`EnvUnavailable`, tried again;
    terminal: :class:`InvalidInput`). The legacy adapters' flat forms are read too."""
    if isinstance(reply, dict) and "failure" in reply and reply.get("failure") is not None:
        failure = reply["failure"]
        terminal, stage = bool(failure.get("terminal")), failure.get("stage") or "?"
        reason = str(failure.get("failure_reason", ""))[:300]
    elif isinstance(reply, dict) and "_ng_failure_class" in reply:  # single_agent_turn_legacy
        terminal, stage = bool(reply.get("_ng_failure_terminal")), reply.get("_ng_failure_stage")
        reason = str(reply.get("_ng_failure_message", ""))[:300]
    else:
        result = reply.get("result") if isinstance(reply, dict) and "episode_id" in reply else reply
        return outcome_of(result, where)
    message = f"{where} failed the episode at its {stage} stage: {reason}"
    raise InvalidInput(message) if terminal else EnvUnavailable(message)


class HttpAgent:
    def __init__(
        self,
        url: str,
        *,
        protocol: AgentProtocol = "run",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url, self.protocol = url, protocol
        # No read timeout: an episode runs as long as it runs; a dead agent is a closed
        # connection, and a retired attempt cancels the call.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0), transport=transport
        )

    async def run(self, task: Mapping[str, Any], session: str, episode: EpisodeRef) -> AgentOutcome:
        headers = {SESSION_HEADER: session, "cookie": f"{SESSION_COOKIE}={session}"}
        if self.protocol == "episode":
            body = episode_request(task, session, episode)
        else:
            body = with_session(task, session)
        try:
            reply = await self._http.post(self.url, json=body, headers=headers)
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
            answer = reply.json()
        except ValueError:
            raise InvalidInput(
                f"agent at {self.url} answered no JSON: {reply.text[:200]!r}"
            ) from None
        if self.protocol == "episode":
            return episode_outcome(answer, f"environment server at {self.url}")
        return outcome_of(answer, f"agent at {self.url}")

    async def aclose(self) -> None:
        await self._http.aclose()


AgentFunction = Callable[[str, dict[str, Any]], Awaitable[Any] | Any]


class FunctionAgent:
    def __init__(self, function: AgentFunction, session_url: Callable[[str], str]) -> None:
        self.function, self.session_url = function, session_url
        self.name = getattr(function, "__qualname__", repr(function))

    async def run(self, task: Mapping[str, Any], session: str, episode: EpisodeRef) -> AgentOutcome:
        reply = self.function(self.session_url(session), copy.deepcopy(dict(task)))
        if inspect.isawaitable(reply):
            reply = await reply
        return outcome_of(reply, f"agent {self.name}")

    async def aclose(self) -> None:
        return None
