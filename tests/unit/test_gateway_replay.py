"""The gateway's pure core: a session's record and its replay, and the OpenAI shapes.

Replay answers the recorded calls in order and lets every later call through; a model call
whose prompt or sampling differs from the record, a tool call to another place or with another
body, or a tool reply that differs when made again, is ReplayDiverged naming the call and what
differs. The session's own id, which the gateway puts in ``metadata.rollsafe_session`` and
which each attempt has its own of, never counts as a difference. Responses API input items
(NeMo Gym's, training fields included) become chat messages; a turn's function calls join its
assistant message; tool call ids do not depend on the attempt.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from pydantic import ValidationError

from rollsafe.engine.protocol import SamplingParams
from rollsafe.errors import InvalidInput, ReplayDiverged
from rollsafe.gateway.convert import Answer, ToolCall, chat_reply, responses_prompt, responses_reply
from rollsafe.gateway.record import CallRecord, Replay, SessionRecord, ToolRecord, body_digest
from rollsafe.gateway.wire import ChatRequest, ResponsesRequest

SAMPLING = SamplingParams(seed=7, max_tokens=8)


def _decode(tokens: object) -> str:
    return " ".join(str(t) for t in tokens)  # type: ignore[attr-defined]


def _call(index: int, prompt: tuple[int, ...]) -> CallRecord:
    return CallRecord(
        index=index,
        call_id=f"r-0_g0/t{index}",
        prompt_tokens=prompt,
        sampling=SAMPLING,
        tokens=(5, 6),
        logprobs=(0.0, 0.0),
        weight_versions=(0, 0),
        finish_reason="stop",
        created_at=1,
    )


def _tool(index: int, body: bytes, reply: str = '{"output": "1"}') -> ToolRecord:
    return ToolRecord(
        index=index,
        server="tools",
        method="POST",
        path="/create",
        body_sha256=body_digest(body),
        status=200,
        content_type="application/json",
        reply=reply,
    )


def _record() -> SessionRecord:
    return SessionRecord(
        rollout_id="r-0_g0",
        calls=(_call(0, (1, 2, 3)),),
        tools=(_tool(0, b'{"a": 1, "metadata": {"rollsafe_session": "r-0_g0"}}'),),
    )


def test_replay_answers_the_record_then_lets_calls_through() -> None:
    replay = Replay("r-0_g0-a1", "r-0_g0", _record(), _decode)
    assert replay.recorded_call((1, 2, 3), SAMPLING) == _call(0, (1, 2, 3))
    assert not replay.replaying and replay.replayed_calls == 1
    assert replay.recorded_call((1, 2, 3, 4), SAMPLING) is None  # past the record: generate
    replay.add_call(_call(1, (1, 2, 3, 4)))
    assert [c.index for c in replay.record.calls] == [0, 1]


def test_a_different_prompt_or_sampling_is_refused_by_name() -> None:
    replay = Replay("r-0_g0-a1", "r-0_g0", _record(), _decode)
    with pytest.raises(ReplayDiverged, match=r"model call 0 .*prompt differs at token 2"):
        replay.recorded_call((1, 2, 9), SAMPLING)
    with pytest.raises(ReplayDiverged, match="sampling"):
        replay.recorded_call((1, 2, 3), SAMPLING.model_copy(update={"temperature": 0.5}))


def test_the_session_id_is_not_a_difference() -> None:
    replay = Replay("r-0_g0-a1", "r-0_g0", _record(), _decode)
    body = b'{"metadata": {"rollsafe_session": "r-0_g0-a1"}, "a": 1}'  # another order too
    assert replay.recorded_tool("tools", "POST", "/create", body) is not None
    made = _tool(0, body, reply='{"output": "1"}')
    assert replay.tool_done(made) == made
    assert replay.tools_made == 1


def test_a_different_tool_call_or_reply_is_refused_by_name() -> None:
    replay = Replay("s", "r-0_g0", _record(), _decode)
    with pytest.raises(ReplayDiverged, match=r"tool call 0 .*POST tools/delete"):
        replay.recorded_tool("tools", "POST", "/delete", b'{"a": 1}')
    with pytest.raises(ReplayDiverged, match="tool call 0"):
        replay.recorded_tool("tools", "POST", "/create", b'{"a": 2}')
    body = b'{"a": 1, "metadata": {"rollsafe_session": "s"}}'
    replay.recorded_tool("tools", "POST", "/create", body)
    with pytest.raises(ReplayDiverged, match=r"made again .*answered 200 '\{\"output\": \"2\"\}'"):
        replay.tool_done(_tool(0, body, reply='{"output": "2"}'))  # max id + 1, applied twice


def test_a_record_of_another_rollout_is_refused() -> None:
    with pytest.raises(InvalidInput, match="record is for r-0_g0, not r-1_g0"):
        Replay("s", "r-1_g0", _record(), _decode)
    with pytest.raises(ValidationError, match="format_version"):
        SessionRecord.model_validate({**_record().model_dump(), "format_version": 3})


NEMO_GYM_INPUT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Book it."},
    {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "On it.", "annotations": []}],
    },
    {
        "type": "function_call",
        "call_id": "call_a",
        "name": "create",
        "arguments": '{"x": 1}',
        "id": "call_a",
        "status": "completed",
        "prompt_token_ids": [1],
        "generation_token_ids": [2],
        "generation_log_probs": [-0.5],
    },
    {"type": "function_call_output", "call_id": "call_a", "output": '{"output": "7"}'},
]


def test_responses_input_items_become_chat_messages() -> None:
    request = ResponsesRequest.model_validate(
        {
            "input": NEMO_GYM_INPUT,
            "tools": [{"type": "function", "name": "create"}],
            "parallel_tool_calls": True,
            "temperature": 0.5,
        }
    )
    prompt = responses_prompt(request)
    assert [m["role"] for m in prompt.messages] == ["system", "user", "assistant", "tool"]
    assistant = prompt.messages[2]
    assert assistant["content"] == "On it."
    assert assistant["tool_calls"][0]["function"] == {"name": "create", "arguments": '{"x": 1}'}
    assert prompt.tools == [{"name": "create"}] and prompt.temperature == 0.5


def test_unknown_fields_and_unsupported_values_are_named() -> None:
    with pytest.raises(ValidationError, match="frobnicate"):
        ChatRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}
        )
    with pytest.raises(ValidationError, match="n"):
        ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "n": 2})
    with pytest.raises(ValidationError, match="previous_response_id"):
        ResponsesRequest.model_validate({"input": "hi", "previous_response_id": "resp_1"})
    with pytest.raises(ValidationError, match="tool_call_id"):
        ChatRequest.model_validate({"messages": [{"role": "tool", "content": "x"}]})


def _answer(rollout: str, calls: tuple[ToolCall, ...]) -> Answer:
    return Answer(
        session=f"{rollout}-a3",
        rollout_id=rollout,
        index=2,
        created_at=5,
        prompt_tokens=(1, 2),
        tokens=(3, 4),
        logprobs=(-0.1, -0.2),
        token_texts=("a", "b"),
        content=None,
        tool_calls=calls,
        finish_reason="tool_calls",
        model="tiny",
    )


def test_replies_carry_token_fields_and_ids_that_outlive_the_attempt() -> None:
    calls = (ToolCall("create", '{"x": 1}'),)
    chat = chat_reply(_answer("r-0_g0", calls), logprobs=True)
    message = chat["choices"][0]["message"]
    assert message["generation_token_ids"] == [3, 4] and message["prompt_token_ids"] == [1, 2]
    assert chat["choices"][0]["logprobs"]["content"][1]["logprob"] == -0.2
    request = ResponsesRequest.model_validate({"input": "hi"})
    response = responses_reply(_answer("r-0_g0", calls), request)
    [item] = response["output"]
    assert item["type"] == "function_call" and item["generation_log_probs"] == [-0.1, -0.2]
    again = responses_reply(_answer("r-0_g0", calls), request)  # another attempt, same place
    assert json.dumps(again) == json.dumps(response)
    other = responses_reply(_answer("r-1_g0", calls), request)
    assert other["output"][0]["call_id"] != item["call_id"]


def test_an_moe_answer_carries_its_routes_and_a_dense_one_none() -> None:
    """``routed_experts`` (``[tokens][layers][k]``) beside the token ids when the engine routed;
    a record of format 1 (before routes) is read as it is."""
    calls = (ToolCall("create", '{"x": 1}'),)
    routed = dataclasses.replace(_answer("r-0_g0", calls), routes=(((1, 2),), ((0, 3),)))
    message = chat_reply(routed, logprobs=False)["choices"][0]["message"]
    assert message["routed_experts"] == [[[1, 2]], [[0, 3]]]
    request = ResponsesRequest.model_validate({"input": "hi"})
    assert responses_reply(routed, request)["output"][-1]["routed_experts"] == [[[1, 2]], [[0, 3]]]
    dense = chat_reply(_answer("r-0_g0", calls), logprobs=False)["choices"][0]["message"]
    assert "routed_experts" not in dense
    call = {k: v for k, v in _call(0, (1, 2)).model_dump().items() if k != "routes"}
    before = {"format_version": 1, "rollout_id": "r-0_g0", "calls": [call]}
    assert SessionRecord.model_validate(before).calls[0].routes is None
    with_routes = _call(0, (1, 2)).model_copy(update={"routes": (((1, 2),), ((0, 3),))})
    assert CallRecord.model_validate(with_routes.model_dump(mode="json")) == with_routes


def test_token_fields_sent_back_come_together_as_nemo_gym_checks() -> None:
    base = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    whole = {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [0.0]}
    envelope = {**whole, "routed_experts": "nrlre1:int16:2x1x2:AAAA"}  # NeMo RL's opaque form
    for item in ({**base, **whole}, {**base, **envelope}, base):
        ResponsesRequest.model_validate({"input": [item]})
    with pytest.raises(ValidationError, match="generation_log_probs, generation_token_ids missing"):
        ResponsesRequest.model_validate({"input": [{**base, "prompt_token_ids": [1]}]})
    with pytest.raises(ValidationError, match="routed_experts given"):
        ResponsesRequest.model_validate({"input": [{**base, "routed_experts": [[[1]]]}]})
