"""The text path of rollsafe's tiny models: a tokenizer, a chat template, and a codec between
chats and token ids.

Engines speak token ids only. An agent speaks chats: OpenAI-format messages, tools and tool
calls. This module builds what turns one into the other for the models ``rollsafe engine
make-model`` writes (:mod:`rollsafe.engine.vllm.models`), since nothing can be downloaded:

- :func:`write_tokenizer` trains a byte-level BPE on a built-in corpus
  (:mod:`rollsafe.engine.corpus`) and writes a Hugging Face tokenizer directory
  (``tokenizer.json``, ``tokenizer_config.json`` with the chat template) that
  ``transformers.AutoTokenizer`` and vLLM load. The same vocabulary size gives the same files,
  byte for byte.
- :data:`CHAT_TEMPLATE` is ChatML with Hermes tool calls, as Qwen2.5 renders them: tools are
  listed in the system turn, an assistant's calls are ``<tool_call>`` JSON blocks, tool results
  go back in a user turn as ``<tool_response>`` blocks.
- :class:`ChatCodec` renders a chat into prompt token ids, and decodes generated ids back;
  :func:`parse_assistant` splits a decoded answer into content and tool calls.

Text is NFC-normalised on the way in, as Qwen2's tokenizer does: any text in NFC comes back
from a round trip byte for byte; other text comes back NFC-composed. transformers 5 rebuilds the
tokenizer of a ``qwen2`` model directory with Qwen2's own normalizer and pre-tokenizer (keeping
only the vocabulary and merges of ``tokenizer.json``); training with exactly that pipeline makes
every loader cut every text into the same ids.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from rollsafe.engine.corpus import corpus
from rollsafe.errors import InvalidInput

if TYPE_CHECKING:
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerBase

# The vocabulary of make-model's models (rollsafe.engine.vllm.models.ModelSpec uses it).
VOCAB_SIZE = 1024

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
# Special: dropped by decode(skip_special_tokens=True).
CONTROL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Whole tokens but not special, as in Qwen2.5: a decode that skips special tokens (vLLM's
# default) keeps them, so a tool-call parser still finds the blocks.
TOOL_MARKERS = (TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END)
ADDED_TOKENS = CONTROL_TOKENS + TOOL_MARKERS
BYTES = 256  # a byte-level BPE starts from one token per byte
MIN_VOCAB_SIZE = BYTES + len(ADDED_TOKENS)

ROLES = ("system", "user", "assistant", "tool")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Qwen2's pre-tokenizer pattern (transformers' Qwen2Tokenizer): see the module docstring.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more of the functions below to answer. Each is described "
    "by a JSON object on its own line between <tools></tools>:\n<tools>"
)
TOOLS_OUTRO = (
    "\n</tools>\n\nTo call a function, answer with a JSON object holding its name and its "
    f"arguments between {TOOL_CALL}{TOOL_CALL_END} tags:\n{TOOL_CALL}\n"
    f'{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_END}'
)

# Jinja, run by transformers' apply_chat_template (and vLLM's). Tools are written with sorted
# keys: the same tools give the same prompt however the caller ordered their keys. Arguments
# given as a string (OpenAI's format) are written as they are; a mapping is written as
# json.dumps would, which is how parse_assistant returns them.
_TEMPLATE = r"""{#- ChatML with Hermes tool calls, from rollsafe.engine.text -#}
{%- set system = messages[0] if messages and messages[0].role == 'system' else none %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if system and system.content %}{{- system.content + '\n\n' }}{%- endif %}
    {{- @INTRO@ }}
    {%- for tool in tools %}{{- '\n' + tool | tojson(sort_keys=true) }}{%- endfor %}
    {{- @OUTRO@ + '<|im_end|>\n' }}
{%- elif system %}
    {{- '<|im_start|>system\n' + (system.content or '') + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + (message.content or '') + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' + (message.content or '') }}
        {%- for call in message.tool_calls or [] %}
            {%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": ' + call.function.name | tojson + ', "arguments": ' }}
            {%- if call.function.arguments is string %}{{- call.function.arguments }}
            {%- else %}{{- call.function.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role in ['system', 'user'] %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
    {%- else %}
        {{- raise_exception('unknown role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
# json.dumps makes a string literal Jinja reads back (it unescapes \n, \" and \uXXXX).
CHAT_TEMPLATE = _TEMPLATE.replace("@INTRO@", json.dumps(TOOLS_INTRO)).replace(
    "@OUTRO@", json.dumps(TOOLS_OUTRO)
)

_TOOL_CALL_BLOCK = re.compile(f"{re.escape(TOOL_CALL)}(.*?){re.escape(TOOL_CALL_END)}", re.DOTALL)


# -- the tokenizer ------------------------------------------------------------------------------


def train_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE of exactly ``vocab_size`` tokens trained on the built-in corpus: the
    learnt tokens (the 256 bytes first), then :data:`ADDED_TOKENS` at the end, as Qwen's are.
    The same ``vocab_size`` always gives the same tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    if vocab_size < MIN_VOCAB_SIZE:
        raise InvalidInput(
            f"a vocabulary of {vocab_size} cannot hold the {BYTES} bytes and the "
            f"{len(ADDED_TOKENS)} special tokens: it needs at least {MIN_VOCAB_SIZE}"
        )
    learnt = vocab_size - len(ADDED_TOKENS)
    tokenizer = Tokenizer(BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = BpeTrainer(vocab_size=learnt, show_progress=False, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(_training_text(), trainer)
    if tokenizer.get_vocab_size() != learnt:  # the corpus ran out of pairs to merge
        most = tokenizer.get_vocab_size() + len(ADDED_TOKENS)
        raise InvalidInput(f"the built-in corpus gives at most {most} tokens, not {vocab_size}")
    tokenizer.add_special_tokens([_added(token) for token in CONTROL_TOKENS])
    tokenizer.add_tokens([_added(token) for token in TOOL_MARKERS])
    return tokenizer


def write_tokenizer(directory: str | Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train (:func:`train_tokenizer`) and write a Hugging Face tokenizer into ``directory``
    (made if missing): :data:`TOKENIZER_FILES`, the chat template in the config. Returns it."""
    tokenizer = train_tokenizer(vocab_size)  # first: a refused vocabulary writes nothing
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    _write(root / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    config = json.dumps(_tokenizer_config(tokenizer), indent=2, sort_keys=True)
    _write(root / "tokenizer_config.json", config + "\n")  # last: see has_tokenizer
    return root


def has_tokenizer(directory: str | Path) -> bool:
    """Whether ``directory`` holds both :data:`TOKENIZER_FILES`."""
    return all((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def _training_text() -> Iterator[str]:
    """The corpus and the template's own words, without the added tokens: those are whole
    tokens whatever the text around them, so merges spent on their pieces would be wasted."""
    split = re.compile("|".join(map(re.escape, ADDED_TOKENS)))
    for text in (*corpus(), TOOLS_INTRO, TOOLS_OUTRO):
        yield from (piece for piece in split.split(text) if piece)


def _added(token: str) -> AddedToken:
    from tokenizers import AddedToken

    # Not normalised: matched on the text as given, as Qwen's are.
    return AddedToken(token, special=token in CONTROL_TOKENS, normalized=False)


def _tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """``tokenizer_config.json``. transformers 5 takes the class from here, unless the model
    type of ``config.json`` names its own: qwen2 then loads as Qwen2Tokenizer, which reads the
    added tokens from ``added_tokens_decoder`` and nothing else of ``tokenizer.json`` but the
    vocabulary and merges."""
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in CONTROL_TOKENS,
        }
        for token in ADDED_TOKENS
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _write(path: Path, text: str) -> None:
    """Written beside and renamed: a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


# -- answers ------------------------------------------------------------------------------------


class ToolCall(BaseModel):
    """One call of a tool. ``arguments``: a JSON object as a string, as OpenAI returns it,
    written ``json.dumps(arguments, ensure_ascii=False)``: keys in the model's order, ``", "``
    and ``": "`` between items, which is how :data:`CHAT_TEMPLATE` writes a mapping, so a
    call parsed from the template's own form renders back to the same text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    arguments: str


class ParsedAssistant(BaseModel):
    """An assistant's answer: ``content`` (the text outside the tool calls, stripped; None if
    nothing is left) and its tool calls, in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


def parse_assistant(text: str) -> ParsedAssistant:
    """Split a decoded answer into content and Hermes ``<tool_call>{json}</tool_call>`` blocks.
    A block that is not a JSON object with a string ``name`` (and an object ``arguments``, or
    none) stays in the content, as does an unclosed one: never raises on what a model wrote."""
    kept: list[str] = []
    calls: list[ToolCall] = []
    end = 0
    for block in _TOOL_CALL_BLOCK.finditer(text):
        call = _tool_call(block.group(1))
        if call is not None:
            kept.append(text[end : block.start()])
            calls.append(call)
            end = block.end()
    kept.append(text[end:])
    content = "".join(kept).strip()
    return ParsedAssistant(content=content or None, tool_calls=tuple(calls))


def _tool_call(body: str) -> ToolCall | None:
    """The call a block's body holds, or None if it holds none."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False))


# -- chats and token ids ------------------------------------------------------------------------


class ChatCodec:
    """Chats to prompt token ids and generated token ids to text, with a model directory's
    tokenizer. ``ChatCodec.load(directory)``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not tokenizer.chat_template:
            raise InvalidInput("the tokenizer has no chat template")
        self._tokenizer = tokenizer
        self.stop_token_ids: tuple[int, ...] = (self._id(IM_END), self._id(ENDOFTEXT))

    @classmethod
    def load(cls, directory: str | Path) -> ChatCodec:
        """The codec of a directory ``write_tokenizer`` (or ``make-model``) wrote."""
        from transformers import AutoTokenizer

        root = Path(directory)
        if not has_tokenizer(root):
            raise InvalidInput(
                f"{root} has no tokenizer ({' and '.join(TOKENIZER_FILES)}): "
                "make the model directory with `rollsafe engine make-model`"
            )
        return cls(AutoTokenizer.from_pretrained(str(root)))

    @property
    def vocab_size(self) -> int:
        """Every token id, added tokens included: ids run from 0 to ``vocab_size - 1``."""
        return len(self._tokenizer)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[int, ...]:
        """The prompt of a chat (OpenAI format), ending with the assistant's turn opened."""
        text = self._tokenizer.apply_chat_template(
            _checked_messages(messages),
            tools=_checked_tools(tools),
            add_generation_prompt=True,
            tokenize=False,
        )
        assert isinstance(text, str)
        return self.encode(text)

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of ``text``; added tokens written in it become those tokens."""
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return tuple(int(token) for token in ids)

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of generated tokens: a final stop token (:attr:`stop_token_ids`) is
        dropped, every other token kept, tool-call markers included."""
        ids = [int(token) for token in tokens]
        if outside := [token for token in ids if not 0 <= token < self.vocab_size]:
            raise InvalidInput(f"token {outside[0]} is outside the vocabulary of {self.vocab_size}")
        if ids and ids[-1] in self.stop_token_ids:
            ids.pop()
        return str(
            self._tokenizer.decode(
                ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    def _id(self, token: str) -> int:
        found = self._tokenizer.convert_tokens_to_ids(token)
        if not isinstance(found, int) or self._tokenizer.convert_ids_to_tokens(found) != token:
            raise InvalidInput(f"the tokenizer has no {token} token")
        return found


def _checked_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, str) or not isinstance(messages, Sequence):
        raise InvalidInput(f"messages must be a list, not {type(messages).__name__}")
    if not messages:
        raise InvalidInput("messages is empty: a chat needs at least one message")
    return [_checked_message(f"messages[{i}]", message) for i, message in enumerate(messages)]


def _checked_message(where: str, message: object) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidInput(f"{where} must be a dict, not {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidInput(f"{where} has role {role!r}: expected one of {', '.join(ROLES)}")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise InvalidInput(f"{where}.content must be a string or null")
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise InvalidInput(f"{where} has tool_calls but role {role!r}: only an assistant's")
        if isinstance(calls, str) or not isinstance(calls, Sequence):
            raise InvalidInput(f"{where}.tool_calls must be a list")
        for i, call in enumerate(calls):
            _check_tool_call(f"{where}.tool_calls[{i}]", call)
    return dict(message)


def _check_tool_call(where: str, call: object) -> None:
    """OpenAI's form: ``{"type": "function", "function": {"name", "arguments"}, "id"}``."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise InvalidInput(f"{where} must be a dict with a function")
    if not isinstance(function.get("name"), str):
        raise InvalidInput(f"{where}.function.name must be a string")
    if not isinstance(function.get("arguments"), str | Mapping):
        raise InvalidInput(f"{where}.function.arguments must be a JSON string or a dict")


def _checked_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if isinstance(tools, str) or not isinstance(tools, Sequence):
        raise InvalidInput(f"tools must be a list, not {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise InvalidInput(f"tools[{i}] must be a dict, not {type(tool).__name__}")
    return [dict(tool) for tool in tools] or None
