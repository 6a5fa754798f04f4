"""A model call's text as it is generated: what of it a stream may send before the call ends.

Pure, no I/O. :class:`LiveText` takes the call's tokens as the engine makes them (a resumed
call's staged prefix first) and answers the *content* delta that is safe to send now: text that
the finished answer's content (:meth:`rollsafe.gateway.sessions.LiveSession` ``_answer``) is
sure to begin with, so a stream's deltas joined are that content exactly. What it holds back
until it is settled:

- the bytes of a character not yet whole (a token may end inside a multi-byte character);
- the end of the text that could still begin a stop string, and everything after a stop;
- with tool calls parsed: a ``<tool_call>`` block from its opening on (a valid block is not
  content; an invalid or unclosed one is, once that is known), the end that could begin one,
  whitespace before the first visible character and at the end (the content is stripped).

Decoding is incremental (:class:`Detokenizer`: a window of the last few tokens, as vLLM's
detokenizer does), so a token costs the same at the end of a long answer as at its start; the
finished answer's stop is found the same way (:func:`stop_cut`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from rollsafe.engine.text import TOOL_CALL, TOOL_CALL_END, parse_assistant

log = logging.getLogger(__name__)
Decode = Callable[[Sequence[int]], str]
_INCOMPLETE = "\ufffd"  # what a decoder makes of a character's first bytes alone


class Detokenizer:
    """Tokens to text one at a time: :attr:`text` holds every whole character so far, and
    :attr:`pending` what the tokens after them decode to now (a character's first bytes)."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix_offset = 0  # the window: tokens[prefix_offset:read_offset] is decoded
        self._read_offset = 0  # already, at the end of self.text
        self.text = ""
        self.pending = ""

    def push(self, token: int) -> None:
        self._tokens.append(token)
        before = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        after = self._decode(self._tokens[self._prefix_offset :])
        self.pending = after[len(before) :]
        if len(after) > len(before) and not after.endswith(_INCOMPLETE):
            self.text += self.pending
            self.pending = ""
            self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)


def stop_cut(decode: Decode, tokens: Sequence[int], stops: Sequence[str]) -> int | None:
    """How many of ``tokens`` make the text up to and including the first stop string; None:
    none occurs. A stop string may end inside a multi-byte character's token."""
    stops = [s for s in stops if s]
    if not stops:
        return None
    text = Detokenizer(decode)
    for n, token in enumerate(tokens, 1):
        seen = len(text.text)
        text.push(token)
        tail = text.text[max(0, seen - max(map(len, stops)) + 1) :] + text.pending
        if any(stop in tail for stop in stops):
            return n
    return None


class LiveText:
    """The streamable content of one call (see the module docstring)."""

    def __init__(self, decode: Decode, stops: Sequence[str], parse_tools: bool) -> None:
        self._text = Detokenizer(decode)
        self._stops = tuple(s for s in stops if s)
        self._parse_tools = parse_tools
        self._stopped = False
        self.sent = ""  # the content sent so far

    def push(self, tokens: Sequence[int]) -> str:
        """Take the next tokens; returns the content that may be sent now ("" for none)."""
        for token in tokens:
            self._text.push(token)
        safe = self._safe_content()
        if not safe.startswith(self.sent):  # never: what was sent was settled
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta

    def finish(self, content: str | None) -> str:
        """The rest of the finished answer's ``content`` after what was sent; "" if the sent
        text is not its beginning (a decoder whose pieces do not join to the whole: logged,
        and the stream's last chunk carries the answer's token ids all the same)."""
        content = content or ""
        if not content.startswith(self.sent):
            log.warning(
                "streamed text %r is not the start of the answer's content %r: its rest is "
                "not sent as text",
                self.sent[-40:],
                content[:80],
            )
            return ""
        rest, self.sent = content[len(self.sent) :], content
        return rest

    def _visible(self) -> str:
        """The text before the first stop string, less an end that may begin one."""
        text = self._text.text
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0:
                text, self._stopped = text[:at], True
        if self._stopped or not self._stops:
            return text
        return text[: len(text) - _partial_end(text, self._stops)]

    def _safe_content(self) -> str:
        text = self._visible()
        if not self._parse_tools:
            return text
        settled = _before_open_block(text)
        settled = settled[: len(settled) - _partial_end(settled, (TOOL_CALL,))]
        # The settled text's content as the answer's parse makes it: stripped at both ends,
        # which at the end holds back whitespace that more text may keep.
        return parse_assistant(settled).content or ""


def _partial_end(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could begin one of ``markers``."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest


def _before_open_block(text: str) -> str:
    """``text`` up to a ``<tool_call>`` that has not closed (its fate is not known yet)."""
    end, at = 0, text.find(TOOL_CALL)
    while at >= 0:
        close = text.find(TOOL_CALL_END, at + len(TOOL_CALL))
        if close < 0:
            return text[:at]
        end = close + len(TOOL_CALL_END)
        at = text.find(TOOL_CALL, end)
    return text
