"""The scripted engine: a policy that says what it is told, token by token, behind the engine
protocol (``rollsafe engine serve --backend scripted --model DIR --script FILE``).

A tiny random model never calls a tool, so tests and the NeMo Gym demo need a policy that does.
This engine decodes each call's prompt with the model directory's tokenizer, picks the first
rule of its script whose ``when`` (a regular expression) occurs in the prompt's last message,
and emits the rule's ``reply`` encoded with the same tokenizer, one token per round, then the
end-of-turn token. Everything else is the engine loop's, as for the other engines: calls are
cut at a token boundary, resumed from a prefix (token ``n`` of a reply is the same whatever
happened before), held by a hold rule, and refused when malformed. Logprobs are 0.0: the
script's choice has probability one.

A reply may name the groups of its rule's match as ``\\g<1>`` or ``\\g<name>`` (nothing else in
it is an escape, unlike ``re.sub``'s replacement: a reply is mostly JSON): one rule then answers
many tasks, e.g. ``"when": "Put '(?P<event>[^']+)' on"`` with the event's name in the reply.

Script file (JSON)::

    {"format_version": 1,
     "rules": [{"when": "<tool_response>", "reply": "Done."},
               {"when": "", "reply": "<tool_call>\\n{\\"name\\": ...}\\n</tool_call>"}]}
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rollsafe.engine.loop import CallState, EngineLoop, Sink
from rollsafe.engine.protocol import GenerateRequest
from rollsafe.errors import InvalidInput

SCRIPT_FORMAT: Literal[1] = 1
# The last message of a ChatML prompt: what follows its last "<|im_start|>" but the one the
# generation prompt opens.
_MESSAGE_START = "<|im_start|>"
_GROUP_REFERENCE = re.compile(r"\\g<(\w+)>")


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    when: str = Field(description="a regular expression searched in the prompt's last message")
    reply: str = Field(min_length=1)

    @field_validator("when")
    @classmethod
    def _a_pattern(cls, when: str) -> str:
        try:
            re.compile(when)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        return when


class Script(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[1] = SCRIPT_FORMAT
    rules: tuple[Rule, ...] = Field(min_length=1)

    def reply(self, prompt: str) -> str:
        last = last_message(prompt)
        for rule in self.rules:
            match = re.search(rule.when, last)
            if match is not None:
                return _expand(match, rule.reply)
        raise InvalidInput(f"no rule of the script matches the last message {last[:120]!r}")


def _expand(match: re.Match[str], reply: str) -> str:
    return _GROUP_REFERENCE.sub(lambda ref: _group(match, ref.group(1)), reply)


def _group(match: re.Match[str], name: str) -> str:
    try:
        return match.group(int(name) if name.isdigit() else name) or ""
    except IndexError:
        raise InvalidInput(
            f"a reply names group {name!r}, which its rule {match.re.pattern!r} does not have"
        ) from None


def last_message(prompt: str) -> str:
    """The last message before the generation prompt (``<|im_start|>assistant``)."""
    parts = prompt.split(_MESSAGE_START)
    if len(parts) >= 3 and parts[-1].startswith("assistant"):
        return parts[-2]
    return parts[-1]


def load_script(path: str | Path) -> Script:
    try:
        return Script.model_validate_json(Path(path).read_bytes())
    except OSError as exc:
        raise InvalidInput(f"--script {path}: cannot read it: {exc.strerror or exc}") from None
    except ValidationError as exc:
        raise InvalidInput(f"--script {path}: {exc}") from None


@dataclass(kw_only=True)
class ScriptedCall(CallState):
    reply: tuple[int, ...] = field(default_factory=tuple)


class ScriptedEngine(EngineLoop[ScriptedCall]):
    """See the module docstring. ``encode``/``decode``: the model directory's tokenizer."""

    def __init__(
        self,
        script: Script,
        *,
        encode: Callable[[str], Sequence[int]],
        decode: Callable[[Sequence[int]], str],
        end_token: int,
        vocab_size: int,
        context: int = 32_768,
    ) -> None:
        super().__init__("rollsafe-scripted-engine")
        self.script = script
        self._encode, self._decode, self._end = encode, decode, end_token
        self.fingerprint = hashlib.sha256(
            f"scripted:{script.model_dump_json()}:{vocab_size}".encode()
        ).hexdigest()
        self.kind = "dense"
        self.vocab_size = vocab_size
        self.context = context
        self.weight_version = 0
        self._thread.start()

    def _new_call(self, request: GenerateRequest, sink: Sink) -> ScriptedCall:
        text = self.script.reply(self._decode(request.prompt_tokens))
        reply = (*self._encode(text), self._end)
        return ScriptedCall(request=request, sink=sink, reply=tuple(reply))

    def _start(self, call: ScriptedCall) -> None:
        return None  # a resumed call goes on at len(call.tokens): its reply is fixed

    def _round(self) -> None:
        for call in [c for c in self._calls.values() if c.runnable]:
            if self._closing:
                break
            self._run_pending_commands()
            if self._calls.get(call.call_id) is not call or not call.runnable:
                continue
            position = len(call.tokens)
            token = call.reply[position] if position < len(call.reply) else self._end
            if self._made(call, token, 0.0, None) is False and position + 1 >= len(call.reply):
                self._finish(call, "stop")  # the reply is over, whatever the stop tokens are

    def _load(self, weights: Mapping[str, torch.Tensor]) -> None:
        return None  # the script is the policy: a weight update changes only the version
