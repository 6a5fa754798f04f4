"""A durable session's record and its replay: pure, no I/O (docs/gateway.md, "Replay").

A session is one episode's conversation with the gateway: its model calls, numbered in the order
they arrive, and its tool calls, numbered the same way. :class:`SessionRecord` holds each
completed call with everything needed to answer it again (the tokens the model made, the tool
server's reply); a checkpoint commits it as the episode's record.

After a restore the episode runs again from its start. :class:`Replay` answers the calls its
record holds, in order, from the record (same tokens, no generation; the tool call made again
into the freshly seeded tool session, its reply checked against the record), and lets every
call past the record through. A call that differs from the one recorded at its place raises
:class:`~rollsafe.errors.ReplayDiverged` naming what differs, as Temporal's non-determinism
error does: the agent did not do what it did before given the same answers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollsafe.engine.protocol import FinishReason, Route, SamplingParams, TokenIds
from rollsafe.errors import InvalidInput, ReplayDiverged
from rollsafe.gateway.wire import SESSION_METADATA_KEY

# 2: a call may carry its MoE routes. Version 1 records (no routes) are read as they are.
RECORD_FORMAT: Literal[2] = 2
# How much text around a difference a divergence shows.
_CONTEXT_CHARS = 60


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CallRecord(_Strict):
    """One completed model call."""

    index: int = Field(ge=0)
    call_id: str = Field(description="the engine call id the tokens were made (or resumed) under")
    prompt_tokens: TokenIds
    sampling: SamplingParams
    tokens: TokenIds
    logprobs: tuple[float, ...]
    weight_versions: tuple[int, ...]
    finish_reason: FinishReason
    resumed_tokens: int = Field(default=0, ge=0, description="taken from a cut's staged prefix")
    # Answered again as it was: an agent that sends a reply back (NeMo Gym's /verify body holds
    # the last one) sends the same bytes on replay.
    created_at: int = Field(ge=0, description="unix time the answer was first made")
    routes: tuple[Route, ...] | None = Field(
        default=None, description="an MoE engine's experts per generated token: [layer][k]"
    )


class ToolRecord(_Strict):
    """One completed tool call through the tool proxy."""

    index: int = Field(ge=0)
    server: str
    method: str
    path: str
    body_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    status: int
    content_type: str
    reply: str = Field(description="the tool server's reply body, as text")


class SessionRecord(_Strict):
    """What a checkpoint commits for one session (the episode's record)."""

    format_version: Literal[1, 2] = RECORD_FORMAT
    rollout_id: str
    calls: tuple[CallRecord, ...] = ()
    tools: tuple[ToolRecord, ...] = ()


# Keys whose values name the attempt, not what it does, left out when attempts are compared:
# the session the gateway put in a body's metadata, and what a NeMo Gym 0.7 environment server
# names each attempt's resources session with (a fresh random resources_session_id, and the
# episode_id with its attempt).
_ATTEMPT_KEYS = {SESSION_METADATA_KEY: str, "resources_session_id": str, "episode_id": dict}


def without_session(body: bytes | str) -> bytes:
    """``body`` as compared across attempts: a JSON body with every key that names the attempt
    left out (``metadata.rollsafe_session``, ``resources_session_id``, ``episode_id``), in
    canonical form; any other body as it is."""
    raw = body.encode() if isinstance(body, str) else body
    try:
        parsed = json.loads(raw)
    except ValueError:
        return raw
    return json.dumps(_strip_session(parsed), sort_keys=True, separators=(",", ":")).encode()


def _strip_session(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            key: _strip_session(item)
            for key, item in value.items()
            if not (key in _ATTEMPT_KEYS and isinstance(item, _ATTEMPT_KEYS[key]))
        }
    if isinstance(value, list):
        return [_strip_session(item) for item in value]
    return value


def body_digest(body: bytes) -> str:
    return hashlib.sha256(without_session(body)).hexdigest()


class Replay:
    """A live session's calls against its record (None: a fresh episode)."""

    def __init__(
        self,
        session: str,
        rollout_id: str,
        record: SessionRecord | None,
        decode: Callable[[Sequence[int]], str],
    ) -> None:
        if record is not None and record.rollout_id != rollout_id:
            raise InvalidInput(f"record is for {record.rollout_id}, not {rollout_id}")
        self.session = session
        self.record = record or SessionRecord(rollout_id=rollout_id)
        self._decode = decode
        self.calls_made = 0
        self.tools_made = 0
        self.replayed_calls = 0

    @property
    def replaying(self) -> bool:
        return self.calls_made < len(self.record.calls)

    # -- model calls --------------------------------------------------------------------------

    def recorded_call(
        self, prompt_tokens: Sequence[int], sampling: SamplingParams
    ) -> CallRecord | None:
        """The record's answer for the next model call, or None when it is past the record
        (the caller generates it and :meth:`add_call`). Raises :class:`ReplayDiverged`."""
        index = self.calls_made
        if index >= len(self.record.calls):
            return None
        recorded = self.record.calls[index]
        if tuple(prompt_tokens) != recorded.prompt_tokens:
            detail = self._prompt_difference(recorded.prompt_tokens, prompt_tokens)
            raise ReplayDiverged(self.session, f"model call {index}", detail)
        if sampling != recorded.sampling:
            detail = f"sampling: record {recorded.sampling}, now {sampling}"
            raise ReplayDiverged(self.session, f"model call {index}", detail)
        self.calls_made += 1
        self.replayed_calls += 1
        return recorded

    def add_call(self, call: CallRecord) -> None:
        if call.index != self.calls_made or self.replaying:
            raise InvalidInput(f"call {call.index} added at place {self.calls_made}")
        self.record = self.record.model_copy(update={"calls": (*self.record.calls, call)})
        self.calls_made += 1

    def _prompt_difference(self, recorded: Sequence[int], now: Sequence[int]) -> str:
        at = next(
            (i for i, (a, b) in enumerate(zip(recorded, now, strict=False)) if a != b),
            min(len(recorded), len(now)),
        )
        before, after = self._decode(recorded[at:]), self._decode(now[at:])
        return (
            f"the prompt differs at token {at} of {len(recorded)} recorded / {len(now)} now: "
            f"record continues {before[:_CONTEXT_CHARS]!r}, now {after[:_CONTEXT_CHARS]!r}"
        )

    # -- tool calls ---------------------------------------------------------------------------

    def recorded_tool(self, server: str, method: str, path: str, body: bytes) -> ToolRecord | None:
        """The record's tool call at the next place (checked to be this one), or None past the
        record. Either way the caller makes the call (into the session's tool server) and
        :meth:`tool_done`; a replayed call's reply is then checked by :meth:`tool_done`."""
        index = self.tools_made
        if index >= len(self.record.tools):
            return None
        recorded = self.record.tools[index]
        asked = (server, method, path, body_digest(body))
        had = (recorded.server, recorded.method, recorded.path, recorded.body_sha256)
        if asked != had:
            detail = f"record {_describe(*had)}, now {_describe(*asked)}"
            raise ReplayDiverged(self.session, f"tool call {index}", detail)
        return recorded

    def tool_done(self, tool: ToolRecord) -> ToolRecord:
        """Record (or, replaying, check) a tool call's outcome. Replaying, the reply must be the
        recorded one but for the session's own id (``without_session``)."""
        index = self.tools_made
        if tool.index != index:
            raise InvalidInput(f"tool call {tool.index} finished at place {index}")
        if index < len(self.record.tools):
            recorded = self.record.tools[index]
            if (tool.status, without_session(tool.reply)) != (
                recorded.status,
                without_session(recorded.reply),
            ):
                detail = (
                    f"made again into the new tool session it answered {tool.status} "
                    f"{tool.reply[:_CONTEXT_CHARS]!r}, recorded {recorded.status} "
                    f"{recorded.reply[:_CONTEXT_CHARS]!r}"
                )
                raise ReplayDiverged(self.session, f"tool call {index}", detail)
            self.tools_made += 1
            return tool
        self.record = self.record.model_copy(update={"tools": (*self.record.tools, tool)})
        self.tools_made += 1
        return tool


def _describe(server: str, method: str, path: str, digest: str) -> str:
    return f"{method} {server}{path} (body {digest[:12]}…)"
