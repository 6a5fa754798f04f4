"""The text path: the tokenizer trained here, the chat template, the codec between chats and
token ids, tool-call parsing, model directories that carry them, and the reference engine
sized to one."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from rollsafe.cli.app import app as cli
from rollsafe.engine.protocol import FinishEvent, GenerateRequest, SamplingParams, TokenEvent
from rollsafe.engine.text import (
    TOKENIZER_FILES,
    ChatCodec,
    ParsedAssistant,
    ToolCall,
    parse_assistant,
    train_tokenizer,
    write_tokenizer,
)
from rollsafe.engine.torch_engine import TorchEngine
from rollsafe.engine.vllm.models import MARKER, ModelSpec, make_model
from rollsafe.errors import InvalidInput

# Small enough to build in well under a second; the vocabulary is not the default, so a test
# that passes cannot be passing on a default by accident.
TINY = {"hidden_size": 16, "layers": 1, "heads": 2, "kv_heads": 1, "vocab_size": 600}

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in Paris and Tōkyō?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Tōkyō"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 12}'},
    {"role": "tool", "tool_call_id": "c2", "content": '{"temperature": 20}'},
    {"role": "assistant", "content": "Paris: 12 °C, Tōkyō: 20 °C."},
    {"role": "user", "content": "Thanks!"},
]
RENDERED = (
    "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n"
    "You may call one or more of the functions below to answer. Each is described by a JSON "
    "object on its own line between <tools></tools>:\n<tools>\n"
    '{"function": {"description": "The weather of a city.", "name": "get_weather", '
    '"parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], '
    '"type": "object"}}, "type": "function"}\n</tools>\n\n'
    "To call a function, answer with a JSON object holding its name and its arguments between "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris and Tōkyō?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō"}}\n</tool_call>'
    "<|im_end|>\n"
    "<|im_start|>user\n"
    '<tool_response>\n{"temperature": 12}\n</tool_response>\n'
    '<tool_response>\n{"temperature": 20}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\nParis: 12 °C, Tōkyō: 20 °C.<|im_end|>\n"
    "<|im_start|>user\nThanks!<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TEXTS = [
    "Hello! Please create an event on Friday at 14:30.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2.5, null]}}',
    "日本語のテキスト, العربية, Ελληνικά, emoji 🙂👩‍👩‍👧 and a combining café",
    "".join(chr(i) for i in range(128)),  # every ASCII byte, controls and NUL included
    "  leading and trailing spaces, tabs\t\tand\r\nnewlines\n\n  ",
    "\U0010fffd private use, \ufeff byte-order mark, \u200b zero width",
]


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A bare tokenizer directory and the two model directories make-model writes: with a
    config.json that says qwen2, transformers 5 loads the tokenizer as Qwen2Tokenizer, which
    rebuilds it from the vocabulary and merges alone."""
    root = tmp_path_factory.mktemp("text")
    return {
        "bare": write_tokenizer(root / "bare", TINY["vocab_size"]),
        "qwen2": make_model(root / "dense", ModelSpec(arch="dense", **TINY)),
        "qwen3_moe": make_model(root / "moe", ModelSpec(arch="moe", experts=2, **TINY)),
    }


@pytest.fixture(params=["bare", "qwen2", "qwen3_moe"])
def codec(request: pytest.FixtureRequest, directories: dict[str, Path]) -> ChatCodec:
    return ChatCodec.load(directories[request.param])


# --- the tokenizer


def test_the_same_vocabulary_gives_the_same_files_byte_for_byte(tmp_path: Path) -> None:
    one, two = write_tokenizer(tmp_path / "one"), write_tokenizer(tmp_path / "two")
    for name in TOKENIZER_FILES:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    other = write_tokenizer(tmp_path / "other", 700)
    assert (other / "tokenizer.json").read_bytes() != (one / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("size", [263, 600, 1024])
def test_the_vocabulary_has_exactly_the_size_asked(size: int) -> None:
    tokenizer = train_tokenizer(size)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == size
    assert sorted(tokenizer.get_vocab(with_added_tokens=True).values()) == list(range(size))


def test_common_words_and_json_are_tokens_of_several_characters() -> None:
    text = 'Please send the email tomorrow morning: {"name": "send_email", "arguments": {}}'
    tokens = train_tokenizer().encode(text).tokens
    assert len(tokens) < len(text) / 3, tokens
    assert {"Ġemail", "Ġtomorrow", "name", '":'} <= set(tokens)


@pytest.mark.parametrize(
    ("size", "message"),
    [(100, "needs at least 263"), (100_000, "the built-in corpus gives at most")],
)
def test_a_vocabulary_the_corpus_cannot_fill_is_refused(size: int, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        train_tokenizer(size)


@pytest.mark.parametrize("text", TEXTS)
def test_text_survives_a_round_trip_through_every_loader(codec: ChatCodec, text: str) -> None:
    tokens = codec.encode(text)
    assert tokens == tuple(train_tokenizer(TINY["vocab_size"]).encode(text).ids)
    assert all(type(token) is int and 0 <= token < codec.vocab_size for token in tokens)
    assert codec.decode(tokens) == text


def test_text_is_nfc_normalised_on_the_way_in(codec: ChatCodec) -> None:
    decomposed = "cafe\u0301"
    assert codec.decode(codec.encode(decomposed)) == unicodedata.normalize("NFC", decomposed)
    assert codec.decode(codec.encode(decomposed)) != decomposed


def test_added_tokens_are_whole_tokens_and_only_control_ones_are_special(
    directories: dict[str, Path],
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directories["qwen2"]))
    text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert (pieces[0], *pieces[-2:]) == ("<|im_start|>", "</tool_call>", "<|im_end|>")
    assert "<tool_call>" in pieces
    kept = tokenizer.decode(ids, skip_special_tokens=True)
    assert kept == "assistant\n<tool_call>\n{}\n</tool_call>"
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")


# --- the chat template and the codec


def test_a_chat_with_tools_renders_in_chatml_with_hermes_tool_calls(codec: ChatCodec) -> None:
    tokens = codec.render(CHAT, tools=[WEATHER])
    assert codec.decode(tokens) == RENDERED
    assert tokens == codec.encode(RENDERED)
    assert all(type(token) is int and 0 <= token < codec.vocab_size for token in tokens)


def test_tools_render_the_same_whatever_the_order_of_their_keys(codec: ChatCodec) -> None:
    def reversed_keys(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: reversed_keys(value[key]) for key in reversed(list(value))}
        return value

    assert list(reversed_keys(WEATHER)) != list(WEATHER)
    assert codec.render(CHAT, [reversed_keys(WEATHER)]) == codec.render(CHAT, [WEATHER])


def test_without_tools_or_system_only_the_turns_render(codec: ChatCodec) -> None:
    tokens = codec.render([{"role": "user", "content": "hi"}])
    assert codec.decode(tokens) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_an_answer_in_the_templates_form_parses_back_to_the_call_it_renders_from(
    codec: ChatCodec,
) -> None:
    calls = [
        {"function": {"name": "get_weather", "arguments": {"city": "Tōkyō", "days": 2}}},
        {"function": {"name": "send_email", "arguments": '{"to": ["a@example.com"]}'}},
    ]
    answer = {"role": "assistant", "content": "Checking.", "tool_calls": calls}
    rendered = codec.decode(codec.render([{"role": "user", "content": "go"}, answer]))
    written = rendered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_assistant(written) == ParsedAssistant(
        content="Checking.",
        tool_calls=(
            ToolCall(name="get_weather", arguments='{"city": "Tōkyō", "days": 2}'),
            ToolCall(name="send_email", arguments='{"to": ["a@example.com"]}'),
        ),
    )


def test_decode_drops_only_a_final_stop_token(codec: ChatCodec) -> None:
    im_end, endoftext = codec.stop_token_ids
    body = codec.encode("<tool_call>\n{}\n</tool_call>")
    assert codec.decode((*body, im_end)) == "<tool_call>\n{}\n</tool_call>"
    assert codec.decode((*body, endoftext)) == "<tool_call>\n{}\n</tool_call>"
    assert codec.decode((im_end, *body)) == "<|im_end|><tool_call>\n{}\n</tool_call>"
    with pytest.raises(InvalidInput, match=f"token {codec.vocab_size} is outside"):
        codec.decode((*body, codec.vocab_size))


@pytest.mark.parametrize(
    ("messages", "tools", "message"),
    [
        ([{"role": "robot", "content": "hi"}], None, r"messages\[0\] has role 'robot'"),
        ([{"content": "hi"}], None, r"messages\[0\] has role None"),
        (["hi"], None, r"messages\[0\] must be a dict, not str"),
        ("hi", None, "messages must be a list, not str"),
        ([], None, "messages is empty"),
        ([{"role": "user", "content": ["a"]}], None, r"messages\[0\].content must be a string"),
        ([{"role": "user", "content": "a", "tool_calls": []}], None, "only an assistant's"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            None,
            r"messages\[0\].tool_calls\[0\].function.name must be a string",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
            None,
            "arguments must be a JSON string or a dict",
        ),
        ([{"role": "user", "content": "hi"}], ["get_weather"], r"tools\[0\] must be a dict"),
    ],
)
def test_a_malformed_chat_is_refused_naming_the_problem(
    directories: dict[str, Path], messages: object, tools: object, message: str
) -> None:
    codec = ChatCodec.load(directories["bare"])
    with pytest.raises(InvalidInput, match=message):
        codec.render(messages, tools)  # type: ignore[arg-type]


def test_a_directory_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(InvalidInput, match="has no tokenizer"):
        ChatCodec.load(tmp_path)


# --- parsing an answer


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("  Just words.\n", ParsedAssistant(content="Just words.")),
        ("", ParsedAssistant(content=None)),
        (
            '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
            ParsedAssistant(content=None, tool_calls=(ToolCall(name="f", arguments='{"x": 1}'),)),
        ),
        (
            'First.\n<tool_call>{"name":"f","arguments":{"a":[1,2]}}</tool_call>\n'
            'then <tool_call>\n{"name": "g"}\n</tool_call> done',
            ParsedAssistant(
                content="First.\n\nthen  done",
                tool_calls=(
                    ToolCall(name="f", arguments='{"a": [1, 2]}'),
                    ToolCall(name="g", arguments="{}"),
                ),
            ),
        ),
        (
            'Oops <tool_call>\n{"name": "f", "arguments": {\n</tool_call>',
            ParsedAssistant(content='Oops <tool_call>\n{"name": "f", "arguments": {\n</tool_call>'),
        ),
        (
            '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "f"}</tool_call>',
            ParsedAssistant(
                content='<tool_call>{"arguments": {}}</tool_call>',
                tool_calls=(ToolCall(name="f", arguments="{}"),),
            ),
        ),
        (
            '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
            ParsedAssistant(content='<tool_call>{"name": "f", "arguments": "x"}</tool_call>'),
        ),
        (
            '<tool_call>["f"]</tool_call> <tool_call>{"name": "f"',
            ParsedAssistant(content='<tool_call>["f"]</tool_call> <tool_call>{"name": "f"'),
        ),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", None),  # nested past the recursion limit
    ],
    ids=[
        "content",
        "empty",
        "one-call",
        "two-calls",
        "malformed-json",
        "no-name",
        "string-arguments",
        "not-an-object-and-unclosed",
        "too-deep",
    ],
)
def test_parse_assistant(text: str, parsed: ParsedAssistant | None) -> None:
    result = parse_assistant(text)
    assert result == (parsed or ParsedAssistant(content=text))
    for call in result.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


# --- model directories


def test_make_model_writes_a_tokenizer_the_size_of_the_models_vocabulary(
    directories: dict[str, Path],
) -> None:
    for name in ("qwen2", "qwen3_moe"):
        root = directories[name]
        config = json.loads((root / "config.json").read_text())
        assert config["model_type"] == name
        assert ChatCodec.load(root).vocab_size == config["vocab_size"] == TINY["vocab_size"]


def test_a_model_made_before_tokenizers_gets_one_when_reused(tmp_path: Path) -> None:
    spec = ModelSpec(**TINY)
    root = make_model(tmp_path / "m", spec)
    written = {name: (root / name).read_bytes() for name in TOKENIZER_FILES}
    for name in TOKENIZER_FILES:
        (root / name).unlink()
    assert make_model(root, spec) == root
    assert {name: (root / name).read_bytes() for name in TOKENIZER_FILES} == written
    assert not [*tmp_path.glob(".*"), *root.glob(".*")]  # no partial directory or file left


def test_make_model_refuses_a_vocabulary_without_writing_anything(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="the built-in corpus gives at most"):
        make_model(tmp_path / "m", ModelSpec(**{**TINY, "vocab_size": 5000}))
    assert not list(tmp_path.iterdir())


def test_make_model_takes_max_positions_on_the_command_line(tmp_path: Path) -> None:
    refused = CliRunner().invoke(
        cli, ["engine", "make-model", str(tmp_path), "--max-positions", "4"]
    )
    assert refused.exit_code == 2
    assert "max_positions: Input should be greater than or equal to 8" in refused.output


# --- the reference engine on a model directory


async def test_the_reference_engine_sized_to_a_directory_speaks_its_tokenizers_ids(
    directories: dict[str, Path],
) -> None:
    root = directories["qwen3_moe"]
    codec = ChatCodec.load(root)
    prompt = codec.render(CHAT, tools=[WEATHER])
    sampling = SamplingParams(seed=7, max_tokens=24, stop_token_ids=codec.stop_token_ids)
    async with TorchEngine.for_model(root) as engine:
        assert (engine.kind, engine.vocab_size, engine.context) == ("moe", 600, 1024)
        request = GenerateRequest(call_id="c1", prompt_tokens=prompt, sampling=sampling)
        events = [event async for event in engine.generate(request)]
    tokens = [event.token for event in events if isinstance(event, TokenEvent)]
    assert isinstance(events[-1], FinishEvent) and events[-1].n_tokens == len(tokens) > 0
    assert all(0 <= token < codec.vocab_size for token in tokens)
    assert isinstance(codec.decode(tokens), str)


def test_the_reference_engine_refuses_a_directory_make_model_did_not_write(
    tmp_path: Path,
) -> None:
    with pytest.raises(InvalidInput, match=f"no {MARKER}"):
        TorchEngine.for_model(tmp_path)
    args = ["engine", "serve", "--port", "0", "--model", str(tmp_path)]
    result = CliRunner().invoke(cli, args, env={"ROLLSAFE_ENGINE_TOKEN": "t"})
    assert result.exit_code == 2
    assert f"is not a model directory rollsafe made (no {MARKER})" in result.output
