"""Between the OpenAI API and the chat template: pure functions, no I/O.

Requests become :class:`Prompt` (the messages and tools the model directory's chat template
renders, in the Hugging Face chat format); a finished call (:class:`Answer`) becomes a chat
completion, its stream of chunks, or a Responses API response or its stream of events. A
streamed call's first pieces are made from its :class:`CallHead` alone, before it ends
(:mod:`rollsafe.gateway.streaming` sends them). Ids the agent sends back later
(tool call ids) are made from the rollout and the call's place only, never the attempt, so a
replayed episode sends back what the first run sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rollsafe.engine.protocol import Route
from rollsafe.gateway.wire import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    ChatMessage,
    ChatRequest,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
)

Message = dict[str, Any]  # one message in the Hugging Face chat format


@dataclass(frozen=True)
class Prompt:
    """What one model call asks: the template's inputs and how to sample."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None
    max_tokens: int
    temperature: float
    top_p: float
    stops: tuple[str, ...] = ()
    parse_tools: bool = True  # tool_choice "none": the text is the answer, never a tool call
    logprobs: bool = False  # each token's text is wanted (chat's logprobs), decoded one by one


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class CallHead:
    """What a model call's reply says of it before it ends: its ids and when it was made."""

    rollout_id: str
    index: int  # the call's place in its session
    created_at: int  # when it was first made: a replayed answer is the same answer
    model: str

    @property
    def response_id(self) -> str:
        return _stable(self.rollout_id, self.index, "response")


@dataclass(frozen=True)
class Answer:
    """A finished model call, as the API reports it."""

    session: str
    rollout_id: str
    index: int  # the call's place in its session
    created_at: int  # when it was first made: a replayed answer is the same answer
    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    token_texts: tuple[str, ...]  # one per token when the prompt asked for logprobs, else ()
    content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str  # "stop", "length" or "tool_calls"
    model: str
    routes: tuple[Route, ...] | None = None  # an MoE engine's experts per token: [layer][k]

    def call_id(self, k: int) -> str:
        """The id of the answer's k-th tool call: stable across attempts."""
        return f"call_{_stable(self.rollout_id, self.index, k)}"

    @property
    def head(self) -> CallHead:
        return CallHead(self.rollout_id, self.index, self.created_at, self.model)

    @property
    def response_id(self) -> str:
        return self.head.response_id


def _stable(*parts: object) -> str:
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:24]


def _function_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A tool call in the chat format (what the template renders, what chat replies carry)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _template_role(role: str) -> str:
    return "system" if role == "developer" else role  # the template knows no developer role


def _text(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


# -- requests ---------------------------------------------------------------------------------


def chat_prompt(request: ChatRequest) -> Prompt:
    messages = [_chat_message(m) for m in request.messages]
    tools = [t.function.model_dump(exclude_none=True) for t in request.tools or ()]
    return _prompt(
        messages,
        tools,
        request.tool_choice == "none",
        max_tokens=request.budget,
        temperature=request.temperature,
        top_p=request.top_p,
        stops=request.stops,
        logprobs=request.logprobs,
    )


def _chat_message(message: ChatMessage) -> Message:
    out: Message = {"role": _template_role(message.role), "content": _text(message.content)}
    if message.tool_calls:
        out["tool_calls"] = [
            _function_call(call.id, call.function.name, call.function.arguments)
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def responses_prompt(request: ResponsesRequest) -> Prompt:
    messages: list[Message] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    items = (
        [MessageItem(role="user", content=request.input)]
        if isinstance(request.input, str)
        else request.input
    )
    for item in items:
        _add_item(messages, item)
    tools = [t.spec().model_dump(exclude_none=True) for t in request.tools]
    return _prompt(
        messages,
        tools,
        request.tool_choice == "none",
        max_tokens=request.budget,
        temperature=request.temperature,
        top_p=request.top_p,
    )


def _add_item(
    messages: list[Message],
    item: MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
) -> None:
    """One Responses input item into chat messages: a turn's function calls join its
    assistant message (as the model made them: text, then calls)."""
    if isinstance(item, MessageItem):
        messages.append({"role": _template_role(item.role), "content": _text(item.content)})
    elif isinstance(item, FunctionCallItem):
        call = _function_call(item.call_id, item.name, item.arguments)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif isinstance(item, FunctionCallOutputItem):
        messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
    # A reasoning item is not rendered: the template has no place for it.


def _prompt(
    messages: list[Message],
    tools: list[dict[str, Any]],
    no_tools: bool,
    *,
    max_tokens: int,
    temperature: float | None,
    top_p: float | None,
    stops: tuple[str, ...] = (),
    logprobs: bool = False,
) -> Prompt:
    return Prompt(
        messages=messages,
        tools=None if no_tools or not tools else tools,
        max_tokens=max_tokens,
        temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
        top_p=DEFAULT_TOP_P if top_p is None else top_p,
        stops=stops,
        parse_tools=not no_tools,
        logprobs=logprobs,
    )


# -- replies ----------------------------------------------------------------------------------


def _training(answer: Answer) -> dict[str, Any]:
    """NeMo Gym's token fields, on the chat message and the last Responses output item: the
    three it requires together, and ``routed_experts`` (``[tokens][layers][k]``, one per
    generated token) when the engine routed."""
    fields: dict[str, Any] = {
        "prompt_token_ids": list(answer.prompt_tokens),
        "generation_token_ids": list(answer.tokens),
        "generation_log_probs": list(answer.logprobs),
    }
    if answer.routes is not None:
        fields["routed_experts"] = [[list(layer) for layer in route] for route in answer.routes]
    return fields


def _logprobs(answer: Answer) -> dict[str, Any]:
    return {
        "content": [
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            for text, lp in zip(answer.token_texts, answer.logprobs, strict=True)
        ]
    }


def _usage(answer: Answer) -> dict[str, int]:
    prompt, completion = len(answer.prompt_tokens), len(answer.tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _chat_tool_calls(answer: Answer) -> list[dict[str, Any]] | None:
    if not answer.tool_calls:
        return None
    return [
        _function_call(answer.call_id(k), call.name, call.arguments)
        for k, call in enumerate(answer.tool_calls)
    ]


def chat_reply(answer: Answer, *, logprobs: bool) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": answer.content,
        "tool_calls": _chat_tool_calls(answer),
        **_training(answer),
    }
    return {
        "id": f"chatcmpl-{answer.response_id}",
        "object": "chat.completion",
        "created": answer.created_at,
        "model": answer.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": _logprobs(answer) if logprobs else None,
                "finish_reason": answer.finish_reason,
            }
        ],
        "usage": _usage(answer),
    }


def chat_chunk(
    head: CallHead, delta: dict[str, Any], finish: str | None = None, lp: Any = None
) -> dict[str, Any]:
    """One chat.completion.chunk of the call ``head`` names."""
    choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
    return {
        "id": f"chatcmpl-{head.response_id}",
        "object": "chat.completion.chunk",
        "created": head.created_at,
        "model": head.model,
        "choices": [choice],
    }


def chat_role_chunk(head: CallHead) -> dict[str, Any]:
    return chat_chunk(head, {"role": "assistant", "content": ""})


def chat_last_chunks(
    answer: Answer, rest: str, *, logprobs: bool, include_usage: bool
) -> Iterator[dict[str, Any]]:
    """The chunks after a stream's live content: ``rest`` of the content (with every token's
    logprob, if asked: they come together here), the tool calls, the finish with the token
    fields, and the usage if asked."""
    head = answer.head
    if rest or logprobs:
        yield chat_chunk(head, {"content": rest}, lp=_logprobs(answer) if logprobs else None)
    calls = _chat_tool_calls(answer)
    if calls:
        yield chat_chunk(
            head, {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
        )
    yield {**chat_chunk(head, {}, answer.finish_reason), **_training(answer)}
    if include_usage:
        yield {**chat_chunk(head, {}), "choices": [], "usage": _usage(answer)}


def responses_reply(answer: Answer, request: ResponsesRequest) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if answer.content or not answer.tool_calls:
        output.append(
            {
                "id": f"msg_{answer.response_id}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": answer.content or "", "annotations": []}
                ],
            }
        )
    for k, call in enumerate(answer.tool_calls):
        call_id = answer.call_id(k)
        output.append(
            {
                "id": call_id,
                "type": "function_call",
                "call_id": call_id,
                "name": call.name,
                "arguments": call.arguments,
                "status": "completed",
            }
        )
    output[-1].update(_training(answer))
    prompt, completion = len(answer.prompt_tokens), len(answer.tokens)
    usage = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
    incomplete = answer.finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    return response_object(answer.head, request, status=status, output=output, usage=usage)


def response_object(
    head: CallHead,
    request: ResponsesRequest,
    *,
    status: str = "in_progress",
    output: list[dict[str, Any]] | None = None,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Responses API's response object of the call ``head`` names: a stream's first
    (``in_progress``, no output yet) or the finished one."""
    return {
        "id": f"resp_{head.response_id}",
        "object": "response",
        "created_at": head.created_at,
        "model": head.model,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": output or [],
        "parallel_tool_calls": request.parallel_tool_calls,
        "tool_choice": request.tool_choice
        if isinstance(request.tool_choice, str)
        else request.tool_choice.model_dump(),
        "tools": [t.model_dump(exclude_none=True) for t in request.tools],
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "instructions": request.instructions,
        "error": None,
        "usage": usage,
    }
