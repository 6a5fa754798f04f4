"""The reference engine: :class:`~rollsafe.engine.model.TinyTransformer` behind the engine
protocol, with continuous batching, cuts and exact resume.

One engine loop (:class:`~rollsafe.engine.loop.EngineLoop`, a thread) owns the model and every
call. Each round it advances every runnable call by one token; calls join and leave between any
two calls of a round. Everything else (admission, cut, release, weight updates) is a
*hand-off*: a command the loop runs between two calls, so it sees each call at a token boundary
and never races the arithmetic.

The arithmetic of each call runs at batch size one (see :mod:`rollsafe.engine.model`): a call's
tokens cannot depend on what else is in flight, which is what makes a resumed call bitwise equal
to the uninterrupted one. A production engine gets the same property from batch-invariant
kernels; this one gets it by construction and pays in throughput.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rollsafe.engine.loop import CallState, EngineLoop, Sink
from rollsafe.engine.model import KVCache, ModelConfig, TinyTransformer
from rollsafe.engine.protocol import GenerateRequest, Route
from rollsafe.engine.sampling import sample
from rollsafe.engine.vllm.models import read_spec

# Prompt (and resumed prefix) tokens fed to one call per round: long prompts do not stall others.
PREFILL_CHUNK = 32
# Events are handed to the event loops in bunches of about this many.
_FLUSH_EVERY = 64


@dataclass(kw_only=True)
class Call(CallState):
    cache: KVCache
    feed: deque[int] = field(default_factory=deque)  # tokens still to run through the model
    logits: torch.Tensor | None = None
    route: Route | None = None


class TorchEngine(EngineLoop[Call]):
    """The reference engine. ``async with TorchEngine(...)`` or call :meth:`close`."""

    def __init__(
        self,
        config: ModelConfig | None = None,
        seed: int = 0,
        *,
        weights: Mapping[str, torch.Tensor] | None = None,
        weight_version: int = 0,
    ) -> None:
        super().__init__("rollsafe-engine")
        self.config = config or ModelConfig()
        self.model = TinyTransformer(self.config, seed)
        if weights is not None:
            self.model.load_state_dict(dict(weights), strict=True)
        self.model.eval()
        self.fingerprint = self.config.fingerprint()
        self.kind = self.config.kind
        self.vocab_size = self.config.vocab_size
        self.context = self.config.max_positions
        self.weight_version = weight_version
        self._thread.start()

    @classmethod
    def for_model(cls, directory: str | Path) -> TorchEngine:
        """The reference engine sized to a directory ``rollsafe engine make-model`` wrote: its
        own transformer (not the directory's weights) with the directory's architecture,
        vocabulary, context and seed, so ids from the directory's tokenizer are its ids."""
        spec = read_spec(directory)
        config = ModelConfig(
            kind=spec.arch, vocab_size=spec.vocab_size, max_positions=spec.max_positions
        )
        return cls(config, spec.seed)

    async def __aenter__(self) -> TorchEngine:
        return self

    # -- the loop -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _owning(self) -> Iterator[None]:
        # Per thread: with the default intra-op pool, tiny ops from a second thread run about
        # four times slower (measured); a batch-one model gains nothing from more threads.
        torch.set_num_threads(1)
        with torch.inference_mode():
            yield

    def _round(self) -> None:
        """Every runnable call advances one token; commands run between any two calls."""
        for call in [c for c in self._calls.values() if c.runnable]:
            if self._closing:
                break
            self._run_pending_commands()
            if self._calls.get(call.call_id) is call and call.runnable:
                self._advance(call)
            if len(self._outbox) >= _FLUSH_EVERY:
                self._flush()

    def _advance(self, call: Call) -> None:
        """Feed what the call still has to feed (a chunk), then sample one token."""
        try:
            budget = PREFILL_CHUNK
            while call.feed and budget:
                if call.cache.length >= call.cache.capacity:
                    self._finish(call, "length")
                    return
                call.logits, call.route = self.model.step(call.feed.popleft(), call.cache)
                budget -= 1
            if call.feed or call.logits is None:
                return
            self._sample(call)
        except Exception as exc:  # one broken call must not take the others down
            self._fail(call, f"call {call.call_id} failed in the engine: {exc}")

    def _sample(self, call: Call) -> None:
        assert call.logits is not None
        token, logprob = sample(call.logits.numpy(), call.request.sampling, len(call.tokens))
        call.logits = None
        if not self._made(call, token, logprob, call.route):
            call.feed.append(token)

    # -- what the loop asks of an engine ------------------------------------------------------

    def _new_call(self, request: GenerateRequest, sink: Sink) -> Call:
        capacity = len(request.prompt_tokens) + request.sampling.max_tokens
        return Call(
            request=request,
            sink=sink,
            cache=self.model.new_cache(capacity),
            feed=deque(request.prompt_tokens),
            routes=[] if self.model.is_moe else None,
        )

    def _start(self, call: Call) -> None:
        call.feed.extend(call.tokens)  # a resumed prefix runs through the model after the prompt

    def _load(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(dict(weights), strict=True)
