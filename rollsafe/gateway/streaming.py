"""Streamed replies: a model call's content sent as the engine makes it (docs/gateway.md,
"Streaming").

:class:`CallStream` runs one call of a session for a streaming request and hands its pieces
out as they come: the call's :class:`~rollsafe.gateway.convert.CallHead` when it starts
generating, content deltas (:class:`~rollsafe.gateway.live.LiveText`: only what the finished
answer's content surely begins with), then the :class:`~rollsafe.gateway.convert.Answer`. A
call a checkpoint cuts while it streams pauses there and goes on from the same token when the
checkpoint resumes; a call resumed after a restore sends its staged prefix first, then the
rest, so a stream's text is the uninterrupted call's either way. A call answered from the
session's record (a replay) comes whole at once.

:func:`chat_sse` and :func:`responses_sse` render the pieces as OpenAI's Server-Sent Events:
``chat.completion.chunk`` objects ending in ``data: [DONE]``; or the Responses API's typed events
(``response.created``, ``response.output_item.added``, ``response.output_text.delta``, ...,
``response.completed``), each with its ``sequence_number``. Tool calls, the token ids (and
``routed_experts``) and, for chat, the logprobs come in the last pieces, once the answer is
known. A call that fails after the stream began ends it with an error (chat: an ``error``
chunk; Responses: ``response.failed``); before it began, the request fails as any other does.
The call runs to its end even if the client goes away, as an unstreamed call does: its place
in the session's record is taken either way.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rollsafe.gateway.convert import (
    Answer,
    CallHead,
    Prompt,
    chat_chunk,
    chat_last_chunks,
    chat_role_chunk,
    response_object,
    responses_reply,
)
from rollsafe.gateway.live import LiveText
from rollsafe.gateway.sessions import LiveSession
from rollsafe.gateway.wire import ResponsesRequest

log = logging.getLogger(__name__)
_RUNNING: set[asyncio.Task[Answer]] = set()  # calls whose client left: kept until they end


@dataclass(frozen=True)
class _Started:
    head: CallHead


@dataclass(frozen=True)
class _Delta:
    text: str


@dataclass(frozen=True)
class _Done:
    pass


_Piece = _Started | _Delta | _Done


class CallStream:
    """One model call of ``session``, its pieces handed out as they come (module docstring)."""

    def __init__(self, session: LiveSession, prompt: Prompt) -> None:
        self.live = LiveText(session.served.codec.decode, prompt.stops, prompt.parse_tools)
        self.model = session.served.model
        self.head: CallHead | None = None  # once started; None for a call from the record
        self._pieces: asyncio.Queue[_Piece] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(session.model_call(prompt, self))
        _RUNNING.add(self._task)
        self._task.add_done_callback(self._ended)

    # -- the session's CallListener ------------------------------------------------------------

    def started(self, rollout_id: str, index: int, created_at: int) -> None:
        self._pieces.put_nowait(_Started(CallHead(rollout_id, index, created_at, self.model)))

    def tokens(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        delta = self.live.push(ids)
        if delta:
            self._pieces.put_nowait(_Delta(delta))

    def _ended(self, task: asyncio.Task[Answer]) -> None:
        _RUNNING.discard(task)
        self._pieces.put_nowait(_Done())
        if not task.cancelled() and task.exception() is not None:
            log.debug("streamed call failed: %r", task.exception())

    # -- the stream's side ---------------------------------------------------------------------

    async def opened(self) -> None:
        """Wait until the call started generating or ended: a call that failed before its
        first piece raises here, while the request can still fail with a status."""
        piece = await self._pieces.get()
        if isinstance(piece, _Started):
            self.head = piece.head
        else:
            self._task.result()  # raises the call's failure, if it failed
            self._pieces.put_nowait(piece)

    async def deltas(self) -> AsyncIterator[str]:
        """The content deltas as they come, until the call ends."""
        while not isinstance(piece := await self._pieces.get(), _Done):
            if isinstance(piece, _Delta):
                yield piece.text

    def answer(self) -> Answer:
        """The finished answer (after :meth:`deltas`); raises the call's failure."""
        return self._task.result()


def _data(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def chat_sse(
    call: CallStream, *, logprobs: bool, include_usage: bool
) -> AsyncIterator[bytes]:
    """The call as chat.completion.chunk events, then ``data: [DONE]``."""
    if call.head is not None:
        yield _data(chat_role_chunk(call.head))
    try:
        async for delta in call.deltas():
            assert call.head is not None  # deltas come only after the start
            yield _data(chat_chunk(call.head, {"content": delta}))
        answer = call.answer()
    except Exception as exc:
        yield _data({"error": _error(exc)})
        return
    if call.head is None:
        yield _data(chat_role_chunk(answer.head))
    rest = call.live.finish(answer.content)
    for chunk in chat_last_chunks(answer, rest, logprobs=logprobs, include_usage=include_usage):
        yield _data(chunk)
    yield b"data: [DONE]\n\n"


class _ResponseEvents:
    """Numbers each event of one Responses stream (``sequence_number``, from 0)."""

    def __init__(self) -> None:
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()


async def responses_sse(call: CallStream, request: ResponsesRequest) -> AsyncIterator[bytes]:
    """The call as the Responses API's events (see the module docstring)."""
    events, opened = _ResponseEvents(), False
    if call.head is not None:
        yield events.event("response.created", response=response_object(call.head, request))
    try:
        async for delta in call.deltas():
            assert call.head is not None
            if not opened:
                opened = True
                for frame in _open_message(events, f"msg_{call.head.response_id}"):
                    yield frame
            yield events.event(
                "response.output_text.delta", **_text_at(call.head), delta=delta, logprobs=[]
            )
        answer = call.answer()
    except Exception as exc:
        yield events.event("response.failed", response=_failed(call, request, exc))
        return
    if call.head is None:
        yield events.event("response.created", response=response_object(answer.head, request))
    final = responses_reply(answer, request)
    rest = call.live.finish(answer.content)
    for index, item in enumerate(final["output"]):
        for frame in _item_events(events, index, item, opened=opened and index == 0, rest=rest):
            yield frame
    yield events.event("response.completed", response=final)


def _failed(call: CallStream, request: ResponsesRequest, exc: Exception) -> dict[str, Any]:
    """The response a failed stream ends with (its call had started: else it failed before)."""
    assert call.head is not None
    failed = response_object(call.head, request, status="failed")
    return {**failed, "error": {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"}}


def _text_at(head: CallHead) -> dict[str, Any]:
    return {"item_id": f"msg_{head.response_id}", "output_index": 0, "content_index": 0}


def _open_message(events: _ResponseEvents, item_id: str) -> Iterator[bytes]:
    item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress"}
    yield events.event("response.output_item.added", output_index=0, item={**item, "content": []})
    part = {"type": "output_text", "text": "", "annotations": []}
    yield events.event(
        "response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part
    )


def _item_events(
    events: _ResponseEvents, index: int, item: dict[str, Any], *, opened: bool, rest: str
) -> Iterator[bytes]:
    """One output item's events after the live part: a message's rest of text and its done
    events (opened first if nothing of it was streamed), a function call's whole."""
    item_id = item["id"]
    if item["type"] == "message":
        if not opened:
            yield from _open_message(events, item_id)
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        if rest:
            yield events.event("response.output_text.delta", **where, delta=rest, logprobs=[])
        [part] = item["content"]
        yield events.event("response.output_text.done", **where, text=part["text"], logprobs=[])
        yield events.event("response.content_part.done", **where, part=part)
    else:
        added = {**item, "arguments": "", "status": "in_progress"}
        yield events.event("response.output_item.added", output_index=index, item=added)
        where = {"item_id": item_id, "output_index": index}
        yield events.event(
            "response.function_call_arguments.delta", **where, delta=item["arguments"]
        )
        yield events.event(
            "response.function_call_arguments.done", **where, arguments=item["arguments"]
        )
    yield events.event("response.output_item.done", output_index=index, item=item)


def _error(exc: Exception) -> dict[str, Any]:
    return {"message": str(exc), "type": type(exc).__name__, "code": getattr(exc, "reason", None)}
