"""One durable session: an episode's model and tool calls, made through its
:class:`~rollsafe.env.hooks.EpisodeSession` so the checkpoint protocol parks, cuts and commits
them as it does any environment's (docs/gateway.md, "Durable sessions").

Every call first waits at a turn boundary (``boundary(model calls done)``): while a checkpoint
parks the gateway, new calls are held there and the session is exported as its record so far.
A model call generates inside ``EpisodeSession.complete`` (cut while parked, resumed from the
staged prefix after a restore). Calls of one session are taken one at a time, in arrival order:
their order is their identity.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rollsafe.engine.protocol import Engine
from rollsafe.engine.text import parse_assistant
from rollsafe.env.hooks import EpisodeSession
from rollsafe.errors import InvalidInput, ParticipantRefused, ReplayDiverged
from rollsafe.gateway.convert import Answer, Prompt, ToolCall
from rollsafe.gateway.live import stop_cut
from rollsafe.gateway.record import CallRecord, Replay, ToolRecord, body_digest


class Codec(Protocol):
    """What the gateway needs of a model directory's tokenizer and chat template
    (:class:`rollsafe.engine.text.ChatCodec`)."""

    stop_token_ids: tuple[int, ...]

    def render(
        self, messages: list[dict[str, object]], tools: list[dict[str, object]] | None = None
    ) -> tuple[int, ...]: ...

    def decode(self, tokens: Sequence[int]) -> str: ...


class Upstream(Protocol):
    """A tool server behind the proxy (:class:`rollsafe.gateway.tools.ToolServer`)."""

    name: str

    async def forward(
        self, session: str, method: str, path: str, body: bytes, content_type: str
    ) -> tuple[int, str, str]: ...

    def forget(self, session: str) -> None: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Served:
    """What the gateway answers with, made once per process."""

    engine: Engine
    codec: Codec
    model: str  # the name /v1/models lists


class CallListener(Protocol):
    """Who streams a model call (:class:`rollsafe.gateway.streaming.CallStream`): told when
    the call starts generating and given its tokens as they come. A call answered from the
    record is neither: its answer is whole at once."""

    def started(self, rollout_id: str, index: int, created_at: int) -> None: ...

    def tokens(self, ids: Sequence[int], logprobs: Sequence[float]) -> None: ...


class LiveSession:
    """The calls of one episode run (a restored run replays its record first)."""

    def __init__(
        self, session: str, episode: EpisodeSession, replay: Replay, served: Served, seed_name: str
    ) -> None:
        self.session, self.episode, self.replay, self.served = session, episode, replay, served
        self.seed_name = seed_name  # "" for an episode's first run; a fallback's samples anew
        self.diverged: ReplayDiverged | None = None
        self.ended = False
        # One lock for model and tool calls: a session's calls are taken one at a time, in
        # arrival order (asyncio.Lock is fair), so the record's order is the agent's.
        self._lock = asyncio.Lock()

    @property
    def rollout_id(self) -> str:
        return self.episode.episode.rollout_id

    def end(self) -> None:
        self.ended = True

    def _check_open(self) -> None:
        if self.ended:
            raise ParticipantRefused(
                "session_ended", f"session {self.session} ended (its episode run is over)"
            )

    def _diverged(self, exc: ReplayDiverged) -> ReplayDiverged:
        self.diverged, self.ended = exc, True
        return exc

    async def model_call(self, prompt: Prompt, listener: CallListener | None = None) -> Answer:
        async with self._lock:
            self._check_open()
            index = self.replay.calls_made
            await self.episode.boundary(index)  # held here while a checkpoint parks us
            self._check_open()
            prompt_tokens = self.served.codec.render(prompt.messages, prompt.tools)
            request = self.episode.request(
                index,
                prompt_tokens,
                max_tokens=prompt.max_tokens,
                temperature=prompt.temperature,
                top_p=prompt.top_p,
                stop_token_ids=self.served.codec.stop_token_ids,
                name=self.seed_name,
            )
            try:
                recorded = self.replay.recorded_call(request.prompt_tokens, request.sampling)
            except ReplayDiverged as exc:
                raise self._diverged(exc) from None
            if recorded is None:
                created_at = int(time.time())
                on_tokens = None
                if listener is not None:
                    listener.started(self.rollout_id, index, created_at)
                    on_tokens = listener.tokens
                completion = await self.episode.complete(
                    self.served.engine, request, on_tokens=on_tokens
                )
                recorded = CallRecord(
                    index=index,
                    call_id=completion.call_id,
                    prompt_tokens=request.prompt_tokens,
                    sampling=request.sampling,
                    tokens=completion.tokens,
                    logprobs=completion.logprobs,
                    weight_versions=completion.weight_versions,
                    finish_reason=completion.finish_reason,
                    resumed_tokens=self.episode.resumed_tokens(completion),
                    created_at=created_at,
                    routes=completion.routes,
                )
                self.replay.add_call(recorded)
            return self._answer(recorded, prompt)

    def _answer(self, call: CallRecord, prompt: Prompt) -> Answer:
        codec = self.served.codec
        tokens, finish = call.tokens, call.finish_reason
        stop_at = stop_cut(codec.decode, tokens, prompt.stops)
        if stop_at is not None:
            tokens, finish = tokens[:stop_at], "stop"
        text = codec.decode(tokens)
        for stop in prompt.stops:  # the stop string itself is not part of the answer
            text = text.split(stop, 1)[0] if stop else text
        content: str | None = text
        tool_calls: tuple[ToolCall, ...] = ()
        if prompt.parse_tools:
            parsed = parse_assistant(text)
            content = parsed.content
            tool_calls = tuple(ToolCall(call.name, call.arguments) for call in parsed.tool_calls)
        return Answer(
            session=self.session,
            rollout_id=self.rollout_id,
            index=call.index,
            created_at=call.created_at,
            prompt_tokens=call.prompt_tokens,
            tokens=tokens,
            logprobs=call.logprobs[: len(tokens)],
            routes=None if call.routes is None else call.routes[: len(tokens)],
            token_texts=tuple(codec.decode((t,)) for t in tokens) if prompt.logprobs else (),
            content=content,
            tool_calls=tool_calls,
            finish_reason="tool_calls" if tool_calls else finish,
            model=self.served.model,
        )

    async def tool_call(
        self, server: Upstream, method: str, path: str, body: bytes, content_type: str
    ) -> ToolRecord:
        """Through the proxy: the call made into this session's tool session (a replayed one
        made again into the freshly seeded one, its reply checked against the record)."""
        async with self._lock:
            self._check_open()
            await self.episode.boundary(self.replay.calls_made)  # nothing in flight here
            self._check_open()
            index = self.replay.tools_made
            try:
                self.replay.recorded_tool(server.name, method, path, body)
            except ReplayDiverged as exc:
                raise self._diverged(exc) from None
            with self.episode.tool():
                status, kind, reply = await server.forward(
                    self.session, method, path, body, content_type
                )
            made = ToolRecord(
                index=index,
                server=server.name,
                method=method,
                path=path,
                body_sha256=body_digest(body),
                status=status,
                content_type=kind,
                reply=reply,
            )
            try:
                return self.replay.tool_done(made)
            except ReplayDiverged as exc:
                raise self._diverged(exc) from None


def check_session_id(session: str) -> str:
    if not session or len(session) > 200 or not all(c.isalnum() or c in "._-" for c in session):
        raise InvalidInput(
            f"session {session[:80]!r}: expected 1-200 characters of A-Z a-z 0-9 . _ -"
        )
    return session
