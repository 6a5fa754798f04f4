"""What a stream may send of a call before it ends (rollsafe.gateway.live), on a BPE trained
here: whatever the text (tool-call blocks valid, invalid or unclosed, stop strings, multi-byte
characters, whitespace at either end) and however its tokens come, the deltas sent are always
the start of the finished answer's content, and with its rest they are that content exactly;
stops are found token by token where decoding every prefix finds them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollsafe.engine.text import ChatCodec, parse_assistant
from rollsafe.gateway.live import LiveText, stop_cut

CALL = '<tool_call>\n{"name": "create", "arguments": {"title": "sync"}}\n</tool_call>'
PIECES = [
    "Sure",
    ", ",
    " ",
    "\n",
    "héllo wörld ",
    "日本語",
    "🙂",
    CALL,
    "<tool_call>not json</tool_call>",
    "<tool_",
    "<tool_call>",
    "</tool_call>",
    "STOP",
    "ST",
    "done.",
]


def _final(codec: ChatCodec, tokens: Sequence[int], stops: tuple[str, ...], parse: bool) -> str:
    """The finished answer's content, as the gateway's session makes it."""
    cut = stop_cut(codec.decode, tokens, stops)
    text = codec.decode(tokens[:cut] if cut is not None else tokens)
    for stop in stops:
        text = text.split(stop, 1)[0]
    return (parse_assistant(text).content or "") if parse else text


def _slow_stop_cut(codec: ChatCodec, tokens: Sequence[int], stops: tuple[str, ...]) -> int | None:
    for n in range(1, len(tokens) + 1):
        if any(stop in codec.decode(tokens[:n]) for stop in stops):
            return n
    return None


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=12),
    chunks=st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=8),
    stops=st.sampled_from([(), ("STOP",), ("STOP", "\n\n")]),
    parse=st.booleans(),
)
def test_the_deltas_are_always_the_start_of_the_answer_and_whole_with_its_rest(
    codec: ChatCodec, pieces: list[str], chunks: list[int], stops: tuple[str, ...], parse: bool
) -> None:
    tokens = codec.encode("".join(pieces))
    final = _final(codec, tokens, stops, parse)
    live, sent, at, k = LiveText(codec.decode, stops, parse), "", 0, 0
    while at < len(tokens):
        size = chunks[k % len(chunks)]
        sent += live.push(tokens[at : at + size])
        assert final.startswith(sent), (sent, final)
        at, k = at + size, k + 1
    assert sent + live.finish(final) == final
    assert stop_cut(codec.decode, tokens, stops) == _slow_stop_cut(codec, tokens, stops)


def test_text_comes_as_it_is_made_and_what_may_still_change_waits(codec: ChatCodec) -> None:
    live = LiveText(codec.decode, ("STOP",), parse_tools=True)
    sent = "".join(live.push((t,)) for t in codec.encode("  Booking it now"))
    assert sent == "Booking it now"  # the leading whitespace the answer strips is never sent
    assert live.push(codec.encode(" <tool_")) == ""  # may begin a tool call: held
    assert live.push(codec.encode('call>{"name": "x"}')) == ""  # an open block: held
    assert live.push(codec.encode("</tool_call> ok ST")) == "  ok"  # a valid call: not content
    assert live.push(codec.encode("OP and more")) == ""  # the stop: nothing after it
    assert live.finish("Booking it now  ok") == ""


def test_an_answer_that_does_not_begin_with_what_was_sent_sends_no_rest(
    codec: ChatCodec, caplog: pytest.LogCaptureFixture
) -> None:
    live = LiveText(codec.decode, (), parse_tools=False)
    assert live.push(codec.encode("abc")) == "abc"
    assert live.finish("xyz") == ""
    assert "is not the start of the answer's content" in caplog.text


def test_a_whole_character_split_across_tokens_is_sent_once_whole(
    codec: ChatCodec, tmp_path: Path
) -> None:
    tokens = codec.encode("日本")
    live = LiveText(codec.decode, (), parse_tools=False)
    sent = [live.push((t,)) for t in tokens]
    assert "".join(sent) == "日本" and all("\ufffd" not in piece for piece in sent)
    assert json.dumps(sent)  # plain strings, ready for a JSON chunk
