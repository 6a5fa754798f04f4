"""The reference engine: :class:`~rollsafe.engine.model.TinyTransformer` behind the engine
protocol, with continuous batching, cuts and exact resume.

One engine loop (a thread) owns the model and every call. Each round it advances every runnable
call by one token; calls join and leave between any two calls of a round. Everything else
(admission, cut, release, weight updates) is a *hand-off*: a command the loop runs between two
calls, so it sees each call at a token boundary and never races the arithmetic.

The arithmetic of each call runs at batch size one (see :mod:`rollsafe.engine.model`): a call's
tokens cannot depend on what else is in flight, which is what makes a resumed call bitwise equal
to the uninterrupted one. A production engine gets the same property from batch-invariant
kernels; this one gets it by construction and pays in throughput.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import torch

from rollsafe.engine.calls import REFUSALS, Call, Frozen, Sink, deliver
from rollsafe.engine.model import ModelConfig, TinyTransformer
from rollsafe.engine.protocol import (
    CUT_BATCH,
    CutRefusal,
    CutReport,
    EngineInfo,
    FinishEvent,
    FinishReason,
    GenerateRequest,
    PrefixRecord,
    RefusalReason,
    StreamEvent,
    TokenEvent,
    prompt_digest,
    seal_prefix,
)
from rollsafe.engine.sampling import sample
from rollsafe.errors import EngineUnavailable, InvalidInput

T = TypeVar("T")

# Prompt (and resumed prefix) tokens fed to one call per round: long prompts do not stall others.
PREFILL_CHUNK = 32
# Events are handed to the event loops in bunches of about this many.
_FLUSH_EVERY = 64


class TorchEngine:
    """The reference engine. ``async with TorchEngine(...)`` or call :meth:`close`."""

    def __init__(
        self,
        config: ModelConfig | None = None,
        seed: int = 0,
        *,
        weights: Mapping[str, torch.Tensor] | None = None,
        weight_version: int = 0,
    ) -> None:
        self.config = config or ModelConfig()
        self.model = TinyTransformer(self.config, seed)
        if weights is not None:
            self.model.load_state_dict(dict(weights), strict=True)
        self.model.eval()
        self.fingerprint = self.config.fingerprint()
        self.weight_version = weight_version
        self.handoffs = 0
        self._calls: dict[str, Call] = {}
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._commands = queue.SimpleQueue()
        self._outbox: list[tuple[Sink, StreamEvent | BaseException]] = []
        self._closing = False
        self._closing_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="rollsafe-engine", daemon=True)
        self._thread.start()

    # -- the protocol -------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        sink = Sink(asyncio.get_running_loop())
        await self._handoff(lambda: self._admit(request, sink, None))
        async for event in self._drain(request.call_id, sink):
            yield event

    async def resume(
        self, request: GenerateRequest, prefix: PrefixRecord
    ) -> AsyncIterator[StreamEvent]:
        prefix.check_request(request, self.fingerprint)
        sink = Sink(asyncio.get_running_loop())
        await self._handoff(lambda: self._admit(request, sink, prefix))
        async for event in self._drain(request.call_id, sink):
            yield event

    async def cut(self, call_ids: Sequence[str], *, batch_size: int = CUT_BATCH) -> CutReport:
        """Freeze each call at its current token count, ``batch_size`` calls per hand-off."""
        if batch_size < 1:
            raise InvalidInput(f"batch_size must be at least 1, not {batch_size}")
        wanted = list(dict.fromkeys(call_ids))
        prefixes: list[PrefixRecord] = []
        refused: list[CutRefusal] = []
        handoffs = 0
        for start in range(0, len(wanted), batch_size):
            batch = wanted[start : start + batch_size]
            got, no = await self._handoff(partial(self._cut_batch, batch))
            prefixes.extend(self._seal(state) for state in got)
            refused.extend(no)
            handoffs += 1
        return CutReport(prefixes=tuple(prefixes), refused=tuple(refused), handoffs=handoffs)

    def _seal(self, state: Frozen) -> PrefixRecord:
        request = state.request
        return seal_prefix(
            call_id=request.call_id,
            model=self.fingerprint,
            prompt_digest=prompt_digest(request.prompt_tokens),
            sampling=request.sampling,
            tokens=state.tokens,
            logprobs=state.logprobs,
            weight_versions=state.versions,
            routes=state.routes,
        )

    async def release(self, call_ids: Sequence[str]) -> int:
        return await self._handoff(lambda: self._release(set(call_ids)))

    async def info(self) -> EngineInfo:
        return await self._handoff(self._info)

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights between two calls' tokens; tokens after it carry ``version``."""
        await self._handoff(lambda: self._load(weights, version))

    async def close(self) -> None:
        """Stop the loop; streams still open end with :class:`EngineUnavailable`."""
        with self._closing_lock:
            self._closing = True
            self._commands.put((lambda: None, concurrent.futures.Future()))  # wake the loop
        await asyncio.to_thread(self._thread.join)

    async def __aenter__(self) -> TorchEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- caller side --------------------------------------------------------------------------

    async def _handoff(self, command: Callable[[], T]) -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        # Checked and queued under the lock close() takes: a command is either refused here
        # or queued before the loop's last drain, never left unanswered.
        with self._closing_lock:
            if self._closing:
                raise EngineUnavailable("engine is closed")
            self._commands.put((command, future))
        return await asyncio.wrap_future(future)

    async def _drain(self, call_id: str, sink: Sink) -> AsyncIterator[StreamEvent]:
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, FinishEvent):
                    finished = True
                    return
        finally:
            if not finished and not self._closing:
                # The caller walked away (cancelled, or broke out): free the call.
                self._commands.put(
                    (partial(self._abandon, call_id, sink), concurrent.futures.Future())
                )

    # -- engine loop --------------------------------------------------------------------------

    def _loop(self) -> None:
        # Per thread: with the default intra-op pool, tiny ops from a second thread run about
        # four times slower (measured); a batch-one model gains nothing from more threads.
        torch.set_num_threads(1)
        with torch.inference_mode():
            while not self._closing:
                runnable = [c for c in self._calls.values() if not c.frozen]
                if not runnable:
                    self._run_command(self._commands.get())
                    continue
                for call in runnable:
                    if self._closing:
                        break
                    self._run_pending_commands()
                    if self._calls.get(call.call_id) is call and not call.frozen:
                        self._advance(call)
                    if len(self._outbox) >= _FLUSH_EVERY:
                        self._flush()
                self._flush()
        for _, future in self._pending_commands():
            future.set_exception(EngineUnavailable("engine closed before the command ran"))
        for call in self._calls.values():
            self._emit(call, EngineUnavailable(f"engine closed while call {call.call_id} ran"))
        self._calls.clear()
        self._flush()

    def _run_pending_commands(self) -> None:
        for item in self._pending_commands():
            self._run_command(item)

    def _pending_commands(self) -> list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]:
        """The commands queued now, not those queued while they run: a client sending commands
        back to back must not keep the loop from decoding (each round gets one batch)."""
        items = []
        for _ in range(self._commands.qsize()):
            try:
                items.append(self._commands.get_nowait())
            except queue.Empty:
                break
        return items

    def _run_command(self, item: tuple[Callable[[], Any], concurrent.futures.Future[Any]]) -> None:
        command, future = item
        self.handoffs += 1
        try:
            future.set_result(command())
        except Exception as exc:  # the caller gets the error; the loop goes on
            future.set_exception(exc)

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
            self._calls.pop(call.call_id, None)
            self._emit(call, EngineUnavailable(f"call {call.call_id} failed in the engine: {exc}"))

    def _sample(self, call: Call) -> None:
        assert call.logits is not None
        params = call.request.sampling
        index = len(call.tokens)
        token, logprob = sample(call.logits.numpy(), params, index)
        call.logits = None
        call.tokens.append(token)
        call.logprobs.append(logprob)
        call.versions.append(self.weight_version)
        if call.routes is not None:
            assert call.route is not None
            call.routes.append(call.route)
        event = TokenEvent(
            call_id=call.call_id,
            index=index,
            token=token,
            logprob=logprob,
            weight_version=self.weight_version,
            route=call.route,
        )
        self._emit(call, event)
        if token in params.stop_token_ids:
            self._finish(call, "stop")
        elif len(call.tokens) >= params.max_tokens:
            self._finish(call, "length")
        else:
            call.feed.append(token)

    def _finish(self, call: Call, reason: FinishReason) -> None:
        self._calls.pop(call.call_id, None)
        self._emit(
            call, FinishEvent(call_id=call.call_id, reason=reason, n_tokens=len(call.tokens))
        )

    def _emit(self, call: Call, item: StreamEvent | BaseException) -> None:
        self._outbox.append((call.sink, item))

    def _flush(self) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sink, StreamEvent | BaseException]]]
        by_loop = {}
        for sink, item in self._outbox:
            by_loop.setdefault(sink.loop, []).append((sink, item))
        self._outbox = []
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that event loop is gone: nobody listens
                loop.call_soon_threadsafe(deliver, items)

    # -- commands (run on the engine loop) ----------------------------------------------------

    def _admit(self, request: GenerateRequest, sink: Sink, prefix: PrefixRecord | None) -> None:
        held = self._calls.get(request.call_id)
        # A restored run resumes from its snapshot's prefix while this engine may still hold
        # the call frozen by that snapshot (the run crashed, the engine did not): the resume
        # supersedes the frozen call. A generating call is never replaced.
        if held is not None and not (held.frozen and prefix is not None):
            raise InvalidInput(f"call {request.call_id!r} is already in flight on this engine")
        if held is not None:
            detail = f"call {request.call_id} was frozen and is superseded by a resume"
            self._emit(held, EngineUnavailable(detail))
        vocab = self.config.vocab_size
        bad = [t for t in request.prompt_tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidInput(
                f"call {request.call_id}: prompt tokens {bad[:5]} outside [0, {vocab})"
            )
        capacity = len(request.prompt_tokens) + request.sampling.max_tokens
        call = Call(
            request=request,
            sink=sink,
            cache=self.model.new_cache(capacity),
            feed=deque(request.prompt_tokens),
            routes=[] if self.model.is_moe else None,
        )
        if prefix is not None:
            call.tokens = list(prefix.tokens)
            call.logprobs = list(prefix.logprobs)
            call.versions = list(prefix.weight_versions)
            call.routes = list(prefix.routes) if prefix.routes is not None else call.routes
            call.feed.extend(prefix.tokens)
        self._calls[request.call_id] = call

    def _cut_batch(self, call_ids: list[str]) -> tuple[list[Frozen], list[CutRefusal]]:
        """Freeze what can be frozen; copy out its state. Sealing (hashing) happens off the
        loop, in :meth:`cut`, so a cut's cost on the loop does not grow with digest work."""
        frozen: list[Frozen] = []
        refused: list[CutRefusal] = []
        for call_id in call_ids:
            call = self._calls.get(call_id)
            if call is None:
                reason: RefusalReason | None = "unknown_call"
            elif call.request.sampling.allowed_token_ids is not None:
                reason = "constrained_decoding"
            elif not call.tokens:
                reason = "no_tokens"
            else:
                reason = None
            if reason is not None or call is None:
                refused.append(CutRefusal(call_id=call_id, reason=reason, detail=REFUSALS[reason]))
                continue
            call.frozen = True
            routes = tuple(call.routes) if call.routes is not None else None
            state = (tuple(call.tokens), tuple(call.logprobs), tuple(call.versions), routes)
            frozen.append(Frozen(call.request, *state))
        return frozen, refused

    def _abandon(self, call_id: str, sink: Sink) -> None:
        # Only this reader's call: a resume may have superseded it under the same id.
        call = self._calls.get(call_id)
        if call is not None and call.sink is sink:
            del self._calls[call_id]

    def _release(self, call_ids: set[str]) -> int:
        released = 0
        for call_id in call_ids:
            call = self._calls.get(call_id)
            if call is not None and call.frozen:
                call.frozen = False
                released += 1
        return released

    def _info(self) -> EngineInfo:
        frozen = sum(1 for c in self._calls.values() if c.frozen)
        return EngineInfo(
            model=self.fingerprint,
            kind=self.config.kind,
            weight_version=self.weight_version,
            active=len(self._calls) - frozen,
            frozen=frozen,
            handoffs=self.handoffs,
        )

    def _load(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        if version <= self.weight_version:
            raise InvalidInput(f"weight version {version} is not newer than {self.weight_version}")
        self.model.load_state_dict(dict(weights), strict=True)
        self.weight_version = version
