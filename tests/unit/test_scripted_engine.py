"""The scripted engine: the first rule whose pattern occurs in the prompt's last message picks
the reply, emitted token by token and ended with the end-of-turn token; a call cut at any
token resumes on a fresh engine with exactly the rest (and, held past its cut, makes nothing
more where it was cut); a reply may name its match's groups; a prompt no rule matches and a
malformed script are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollsafe.engine.loop import HOLD_ENV, EngineLoop, HoldRule
from rollsafe.engine.protocol import GenerateRequest, SamplingParams, completion_of
from rollsafe.engine.scripted import (
    Script,
    ScriptedCall,
    ScriptedEngine,
    last_message,
    load_script,
)
from rollsafe.engine.text import ChatCodec
from rollsafe.errors import InvalidInput
from rollsafe.testing.waiting import eventually_async

SCRIPT = Script.model_validate(
    {
        "rules": [
            {"when": "<tool_response>", "reply": "Done: the meeting is booked."},
            {"when": "", "reply": '<tool_call>\n{"name": "book", "arguments": {}}\n</tool_call>'},
        ]
    }
)


def engine(codec: ChatCodec) -> ScriptedEngine:
    return ScriptedEngine(
        SCRIPT,
        encode=codec.encode,
        decode=codec.decode,
        end_token=codec.stop_token_ids[0],
        vocab_size=codec.vocab_size,
    )


def request(codec: ChatCodec, messages: list[dict[str, object]], call: str) -> GenerateRequest:
    sampling = SamplingParams(seed=1, max_tokens=64, stop_token_ids=codec.stop_token_ids)
    return GenerateRequest(call_id=call, prompt_tokens=codec.render(messages), sampling=sampling)


USER: list[dict[str, object]] = [{"role": "user", "content": "Book it."}]
AFTER_TOOL: list[dict[str, object]] = [
    *USER,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "book", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "c", "content": "ok"},
]


async def test_the_first_matching_rule_replies_token_by_token(codec: ChatCodec) -> None:
    async with engine(codec) as scripted:
        first = request(codec, USER, "s/t0")
        done = completion_of("s/t0", [e async for e in scripted.generate(first)])
        second = request(codec, AFTER_TOOL, "s/t1")
        answer = completion_of("s/t1", [e async for e in scripted.generate(second)])
    assert codec.decode(done.tokens) == SCRIPT.rules[1].reply
    assert codec.decode(answer.tokens) == SCRIPT.rules[0].reply
    assert answer.tokens[-1] == codec.stop_token_ids[0] and answer.finish_reason == "stop"
    assert set(answer.logprobs) == {0.0}


@pytest.mark.parametrize("at", [1, 3, 7])
async def test_a_cut_call_resumes_with_exactly_the_rest(
    codec: ChatCodec, at: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = request(codec, AFTER_TOOL, f"cut-{at}")
    async with engine(codec) as whole:
        expected = completion_of(call.call_id, [e async for e in whole.generate(call)])
    # The engine holds the call after `at` tokens: the cut finds it there, however fast.
    monkeypatch.setenv(HOLD_ENV, HoldRule(after_tokens=at).model_dump_json())
    async with engine(codec) as first:
        stream = first.generate(call)
        await anext(stream)
        await eventually_async(lambda: _held(first), what=f"the call held after {at} tokens")
        [prefix] = (await first.cut([call.call_id])).prefixes
        await stream.aclose()
    assert len(prefix.tokens) == at
    monkeypatch.delenv(HOLD_ENV)
    async with engine(codec) as fresh:  # another process's engine, the same script
        rest = [e async for e in fresh.resume(call, prefix)]
    assert completion_of(call.call_id, rest, prefix).tokens == expected.tokens


async def _held(scripted: EngineLoop[ScriptedCall]) -> bool:
    return (await scripted.info()).held == 1


async def test_a_keep_cut_hold_holds_a_cut_call_again_when_the_cut_is_released(
    codec: ChatCodec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drill's crash after a snapshot finds the calls it cut still in flight: released, the
    call makes no token while another call runs to its end, and a second cut finds the same
    prefix."""
    rule = HoldRule(calls="^held$", after_tokens=3, once=False, keep_cut=True)
    monkeypatch.setenv(HOLD_ENV, rule.model_dump_json())
    async with engine(codec) as scripted:
        stream = scripted.generate(request(codec, AFTER_TOOL, "held"))
        await anext(stream)
        await eventually_async(lambda: _held(scripted), what="the call held after 3 tokens")
        [first] = (await scripted.cut(["held"])).prefixes
        assert await scripted.release(["held"]) == 1
        other = request(codec, AFTER_TOOL, "free")  # rounds in which a thawed call would go on
        done = completion_of("free", [e async for e in scripted.generate(other)])
        info = await scripted.info()
        [again] = (await scripted.cut(["held"])).prefixes
        await stream.aclose()
    assert len(done.tokens) > len(first.tokens) == 3
    assert (info.held, info.frozen) == (1, 0)
    assert again.tokens == first.tokens


def test_a_keep_cut_hold_that_the_first_cut_would_end_is_refused() -> None:
    with pytest.raises(ValueError, match="keep_cut needs once=false"):
        HoldRule(keep_cut=True)


async def test_a_prompt_no_rule_matches_is_refused(codec: ChatCodec) -> None:
    strict = Script.model_validate({"rules": [{"when": "^never$", "reply": "x"}]})
    scripted = ScriptedEngine(
        strict, encode=codec.encode, decode=codec.decode, end_token=0, vocab_size=codec.vocab_size
    )
    async with scripted:
        with pytest.raises(InvalidInput, match="no rule of the script matches"):
            [e async for e in scripted.generate(request(codec, USER, "x/t0"))]


def test_a_reply_names_the_groups_of_its_match_and_nothing_else_is_an_escape() -> None:
    script = Script.model_validate(
        {
            "rules": [
                {
                    "when": r"Put '(?P<event>[^']+)' on (\w+)",
                    "reply": r'{"event_name": "\g<event>", "day": "\g<2>", "raw": "\n\d"}',
                }
            ]
        }
    )
    prompt = "<|im_start|>user\nPut 'standup 7' on Monday<|im_end|>\n<|im_start|>assistant\n"
    assert script.reply(prompt) == r'{"event_name": "standup 7", "day": "Monday", "raw": "\n\d"}'
    unknown = Script.model_validate({"rules": [{"when": "Put", "reply": r"\g<event>"}]})
    with pytest.raises(InvalidInput, match="names group 'event'"):
        unknown.reply(prompt)


def test_the_last_message_is_the_one_before_the_generation_prompt() -> None:
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert last_message(prompt) == "user\nhi<|im_end|>\n"


def test_a_malformed_script_is_refused_by_name(tmp_path: Path) -> None:
    bad = tmp_path / "script.json"
    bad.write_text('{"format_version": 1, "rules": [{"when": "(", "reply": "x"}]}')
    with pytest.raises(InvalidInput, match="not a regular expression"):
        load_script(bad)
    bad.write_text('{"format_version": 1, "rules": []}')
    with pytest.raises(InvalidInput, match="rules"):
        load_script(bad)
    with pytest.raises(InvalidInput, match="cannot read it"):
        load_script(tmp_path / "missing.json")
