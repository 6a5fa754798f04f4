"""The reference engine's per-call state and the hand-over of events to callers' event loops.

Everything here is touched only by the engine loop thread, except :class:`Sink`'s queue, which
:func:`deliver` fills on the caller's event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

import torch

from rollsafe.engine.model import KVCache, Route
from rollsafe.engine.protocol import GenerateRequest, RefusalReason, StreamEvent


class Sink:
    """Where one call's events go: an asyncio queue on the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[StreamEvent | BaseException] = asyncio.Queue()


REFUSALS: dict[RefusalReason | None, str] = {
    "unknown_call": "not in flight on this engine (finished, abandoned or never started)",
    "constrained_decoding": "constraint state is not part of a prefix record",
    "no_tokens": "no token generated yet: restart from the turn",
    None: "",
}


@dataclass(frozen=True)
class Frozen:
    """A frozen call's state, copied out of the engine loop to be sealed outside it."""

    request: GenerateRequest
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    routes: tuple[Route, ...] | None


@dataclass
class Call:
    request: GenerateRequest
    sink: Sink
    cache: KVCache
    feed: deque[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: list[Route] | None = None
    frozen: bool = False
    logits: torch.Tensor | None = None
    route: Route | None = None

    @property
    def call_id(self) -> str:
        return self.request.call_id


def deliver(items: list[tuple[Sink, StreamEvent | BaseException]]) -> None:
    for sink, item in items:
        sink.queue.put_nowait(item)
