"""The gateway's streamed replies (rollsafe.gateway.streaming) on a session stand-in that makes
its call token by token: every event is one the ``openai`` SDK's own types accept; the content
deltas are sent as the tokens come and join to the answer's content; tool calls and the token
fields come last; a call answered from the record comes whole; a call that fails after the
stream began ends it with an error event, one that fails before raises while the request can
still fail with a status."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from rollsafe.engine.text import ChatCodec
from rollsafe.errors import EnvUnavailable, ParticipantRefused
from rollsafe.gateway.convert import Answer, Prompt, ToolCall
from rollsafe.gateway.sessions import CallListener, Served
from rollsafe.gateway.streaming import CallStream, chat_sse, responses_sse
from rollsafe.gateway.wire import ResponsesRequest

TEXT = "Here it is, all of it."
EVENTS = TypeAdapter(ResponseStreamEvent)


class FakeSession:
    """A LiveSession's streaming side: the call's start, its tokens one by one (each after the
    test lets it go, when ``gate`` is given), then its answer; or a failure at ``fail_at``."""

    def __init__(self, codec: ChatCodec, *, replayed: bool = False, fail_at: int | None = None):
        self.served = Served(engine=None, codec=codec, model="tiny")  # type: ignore[arg-type]
        self.tokens = tuple(codec.encode(TEXT))
        self.replayed, self.fail_at = replayed, fail_at
        self.gate: asyncio.Queue[None] | None = None
        self.tool_calls: tuple[ToolCall, ...] = ()

    async def model_call(self, prompt: Prompt, listener: CallListener | None = None) -> Answer:
        if not self.replayed and listener is not None:
            listener.started("r-0_g0", 2, 7)
            for n, token in enumerate(self.tokens):
                if n == self.fail_at:
                    raise EnvUnavailable("engine at http://e gone")
                if self.gate is not None:
                    await self.gate.get()
                listener.tokens((token,), (-0.5,))
        if self.fail_at == -1:
            raise ParticipantRefused("session_ended", "session r-0_g0-a0 ended")
        return Answer(
            session="r-0_g0-a0",
            rollout_id="r-0_g0",
            index=2,
            created_at=7,
            prompt_tokens=(1, 2),
            tokens=self.tokens,
            logprobs=tuple(-0.5 for _ in self.tokens),
            token_texts=tuple(self.served.codec.decode((t,)) for t in self.tokens),
            content=TEXT,
            tool_calls=self.tool_calls,
            finish_reason="tool_calls" if self.tool_calls else "stop",
            model="tiny",
        )


def _prompt() -> Prompt:
    return Prompt(messages=[], tools=None, max_tokens=32, temperature=1.0, top_p=1.0)


async def _opened(session: FakeSession) -> CallStream:
    call = CallStream(session, _prompt())  # type: ignore[arg-type]
    await call.opened()
    return call


async def _frames(events: AsyncIterator[bytes]) -> list[str]:
    return [frame.decode() async for frame in events]


def _chat_chunks(frames: Sequence[str]) -> list[dict[str, Any]]:
    assert frames[-1] == "data: [DONE]\n\n"
    return [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]


def _response_events(frames: Sequence[str]) -> list[dict[str, Any]]:
    events = []
    for frame in frames:
        kind, data = frame.strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        EVENTS.validate_python(event)  # the SDK's own union of stream events
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


async def test_chat_chunks_stream_as_the_tokens_come_and_join_to_the_answer(
    codec: ChatCodec,
) -> None:
    session = FakeSession(codec)
    session.tool_calls = (ToolCall("lookup", '{"q": 1}'),)
    session.gate = asyncio.Queue()
    call = await _opened(session)
    stream = chat_sse(call, logprobs=True, include_usage=True)
    first = json.loads((await anext(stream)).decode().removeprefix("data: "))
    assert first["choices"][0]["delta"]["role"] == "assistant"
    session.gate.put_nowait(None)  # one token made: its text arrives before the call ends
    while True:
        chunk = json.loads((await anext(stream)).decode().removeprefix("data: "))
        if chunk["choices"][0]["delta"].get("content"):
            break
        session.gate.put_nowait(None)
    assert TEXT.startswith(chunk["choices"][0]["delta"]["content"])
    for _ in session.tokens:
        session.gate.put_nowait(None)
    chunks = [first, chunk, *_chat_chunks(await _frames(stream))]
    for each in chunks:
        ChatCompletionChunk.model_validate(each)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == TEXT
    [calls] = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    assert calls["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "lookup"
    [finish] = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish["generation_token_ids"] == list(session.tokens)
    assert chunks[-1]["usage"]["completion_tokens"] == len(session.tokens)
    [logprobs] = [c for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert len(logprobs["choices"][0]["logprobs"]["content"]) == len(session.tokens)


async def test_response_events_are_the_sdks_in_order_and_end_completed(codec: ChatCodec) -> None:
    session = FakeSession(codec)
    session.tool_calls = (ToolCall("lookup", '{"q": 1}'),)
    request = ResponsesRequest.model_validate({"input": "hi", "stream": True})
    events = _response_events(await _frames(responses_sse(await _opened(session), request)))
    kinds = [e["type"] for e in events]
    assert kinds[:3] == [
        "response.created", "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-1] == "response.completed" and "response.function_call_arguments.done" in kinds
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == TEXT
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][-1]["generation_token_ids"] == list(session.tokens)


async def test_a_call_from_the_record_comes_whole(codec: ChatCodec) -> None:
    session = FakeSession(codec, replayed=True)
    call = await _opened(session)
    assert call.head is None
    chunks = _chat_chunks(await _frames(chat_sse(call, logprobs=False, include_usage=False)))
    assert [c["choices"][0]["delta"].get("content") for c in chunks[:2]] == ["", TEXT]
    request = ResponsesRequest.model_validate({"input": "hi", "stream": True})
    again = await _opened(FakeSession(codec, replayed=True))
    events = _response_events(await _frames(responses_sse(again, request)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"


async def test_a_failure_after_the_start_ends_the_stream_with_an_error(codec: ChatCodec) -> None:
    chunks = _error_frames(
        await _frames(
            chat_sse(
                await _opened(FakeSession(codec, fail_at=3)), logprobs=False, include_usage=False
            )
        )
    )
    assert (
        chunks[-1]["error"]["type"] == "EnvUnavailable" and "gone" in chunks[-1]["error"]["message"]
    )
    request = ResponsesRequest.model_validate({"input": "hi", "stream": True})
    events = _response_events(
        await _frames(responses_sse(await _opened(FakeSession(codec, fail_at=3)), request))
    )
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["message"] == "EnvUnavailable: engine at http://e gone"


async def test_a_failure_before_the_start_fails_the_request(codec: ChatCodec) -> None:
    with pytest.raises(ParticipantRefused, match="session_ended"):
        await _opened(FakeSession(codec, replayed=True, fail_at=-1))


def _error_frames(frames: Sequence[str]) -> list[dict[str, Any]]:
    return [json.loads(f.removeprefix("data: ")) for f in frames]
