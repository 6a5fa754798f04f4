"""The engine loop: one thread owns an engine's model and every call; everything else is a
*hand-off*, a command the loop runs between two units of work.

Both engines are built on :class:`EngineLoop`, which implements the protocol's calls
(:class:`~rollsafe.engine.protocol.Engine`) once. The reference engine's unit of work is one
token of one call (a round advances every runnable call by one); vLLM's is one ``step()`` of
its scheduler. Either way a command (admission, cut, release, weight update) sees every call at
a token boundary and never races the arithmetic: that is what makes a cut exact.

A subclass says how a call starts generating (:meth:`EngineLoop._start`), stops for a cut
(:meth:`EngineLoop._freeze`) and goes on after one (:meth:`EngineLoop._thaw`), what one round
of work is (:meth:`EngineLoop._round`) and how weights load (:meth:`EngineLoop._load`); it
reports each token it makes with :meth:`EngineLoop._made`.

Events go back to each caller's event loop in bunches (:meth:`EngineLoop._flush`); a caller
that walks away from a stream frees its call.

A cut answers at once for every call it names: frozen now (its prefix), or why not. The loop
remembers the calls that ended here (``finished``, ``abandoned``), so a call the cut does not find
in flight and does not remember is ``not_admitted``: its request has not arrived (it has no
token to keep, and runs when it comes), so a park window never waits to find out which it was.

Tests and drills can have an engine (the reference engine, vLLM) *hold* calls
(:class:`HoldRule`, from ``ROLLSAFE_ENGINE_HOLD``): a held call stops after its first tokens
and waits, generating nothing. By default the engine's first cut ends the hold: every held
call goes on (a cut one once it is released) and no call is held again; with ``once=False`` a
cut ends it only for the calls it froze, and later calls are held as before; with
``keep_cut`` too, a call a cut froze is held again when the cut is released (it goes on only
where a resume restarts it from its prefix). A snapshot then always finds the calls it is meant
to catch, and a drill that kills the run after it finds them still in flight, however loaded
the machine is, where a test would otherwise race the decode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, Literal, TypeVar

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

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
    Route,
    StreamEvent,
    TokenEvent,
    prompt_digest,
    seal_prefix,
)
from rollsafe.errors import EngineUnavailable, InvalidInput

T = TypeVar("T")
Command = tuple[Callable[[], Any], concurrent.futures.Future[Any]]

REFUSALS: dict[RefusalReason | None, str] = {
    "finished": "finished here: its completion was delivered",
    "abandoned": "its caller walked away",
    "not_admitted": "not admitted here (yet): no token to keep",
    "unknown_call": "not in flight on this engine",
    "constrained_decoding": "constraint state is not part of a prefix record",
    "no_tokens": "no token generated yet: restart from the turn",
    None: "",
}


HOLD_ENV = "ROLLSAFE_ENGINE_HOLD"
# Calls that ended here, remembered (oldest forgotten first) so that a cut can say at once what
# happened to a call it does not find in flight: tens of bytes each, a few MB at most.
REMEMBERED_CALLS = 65_536


class HoldRule(BaseModel):
    """Which calls the engine holds (a test instrument; ``ROLLSAFE_ENGINE_HOLD`` carries it as
    JSON): those whose id ``calls`` matches (``re.search``), once they have made
    ``after_tokens`` tokens while the engine serves weight version ``from_weight_version`` or
    later (so a test can let the first steps run free). ``once``: the engine's first cut ends
    the hold for every call (a run goes on after the snapshot that caught it); otherwise each
    cut ends it for the calls it froze (an engine many tests cut in turn). ``keep_cut`` (with
    ``once`` off): the calls a cut froze are held again when it is released, so the run is
    killed with them in flight (a drill's crash after a snapshot), however slow that kill."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    calls: str = ".*"
    after_tokens: int = Field(default=1, ge=1)
    from_weight_version: int = Field(default=0, ge=0)
    once: bool = True
    keep_cut: bool = False

    @field_validator("calls")
    @classmethod
    def _a_pattern(cls, calls: str) -> str:
        try:
            re.compile(calls)
        except re.error as exc:  # not a ValueError: pydantic would not report it as the field's
            raise ValueError(f"not a regular expression: {exc}") from None
        return calls

    @model_validator(mode="after")
    def _keep_cut_outlives_the_first_cut(self) -> HoldRule:
        if self.keep_cut and self.once:
            raise ValueError("keep_cut needs once=false: the first cut ends a once rule")
        return self

    def holds(self, call: CallState, weight_version: int) -> bool:
        return (
            not call.cut
            and weight_version >= self.from_weight_version
            and len(call.tokens) >= self.after_tokens
            and re.search(self.calls, call.call_id) is not None
        )


def hold_rule_from_env() -> HoldRule | None:
    """The :class:`HoldRule` in ``ROLLSAFE_ENGINE_HOLD``, or None when it is unset."""
    raw = os.environ.get(HOLD_ENV, "")
    if not raw:
        return None
    try:
        return HoldRule.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidInput(f"{HOLD_ENV}={raw!r}: {exc}") from None


class Sink:
    """Where one call's events go: an asyncio queue on the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[StreamEvent | BaseException] = asyncio.Queue()


@dataclass(kw_only=True)
class CallState:
    """What every engine keeps of a call (touched only by the loop thread)."""

    request: GenerateRequest
    sink: Sink
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: list[Route] | None = None  # MoE models: one per token
    frozen: bool = False
    held: bool = False  # stopped by the engine's HoldRule until a cut (past it: keep_cut)
    # Cut at least once, here or (a resume) where its prefix was staged: never held again.
    cut: bool = False

    @property
    def call_id(self) -> str:
        return self.request.call_id

    @property
    def runnable(self) -> bool:
        """Whether a round advances it."""
        return not (self.frozen or self.held)


@dataclass(frozen=True)
class Frozen:
    """A frozen call's state, copied out of the engine loop to be sealed outside it."""

    request: GenerateRequest
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    routes: tuple[Route, ...] | None


CallT = TypeVar("CallT", bound=CallState)


class EngineLoop(Generic[CallT]):
    """The protocol over a loop thread. Subclasses set :attr:`fingerprint`, :attr:`kind`,
    :attr:`vocab_size`, :attr:`context` and :attr:`weight_version`, then call
    ``self._thread.start()`` (:attr:`context` may wait for :meth:`_owning`)."""

    fingerprint: str
    kind: Literal["dense", "moe"]
    vocab_size: int
    context: int  # positions one call may fill: its prompt plus max_tokens, at most
    weight_version: int

    def __init__(self, name: str) -> None:
        self.handoffs = 0
        self._calls: dict[str, CallT] = {}
        # Call id -> how it ended here ("finished" or "abandoned"), for a cut that names it.
        self._ended: OrderedDict[str, RefusalReason] = OrderedDict()
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._outbox: list[tuple[Sink, StreamEvent | BaseException]] = []
        self._closing = False
        self._closing_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._hold = hold_rule_from_env()

    # -- the protocol -------------------------------------------------------------------------

    # Async generator methods, not functions returning one: Ray's actor (ray_actor.py) streams
    # a method only if it is one.
    async def generate(self, request: GenerateRequest) -> AsyncGenerator[StreamEvent, None]:
        sink = Sink(asyncio.get_running_loop())
        await self._handoff(lambda: self._admit(request, sink, None))
        # aclosing: a caller that closes this stream frees the call now, not at GC.
        async with contextlib.aclosing(self._drain(request.call_id, sink)) as events:
            async for event in events:
                yield event

    async def resume(
        self, request: GenerateRequest, prefix: PrefixRecord
    ) -> AsyncGenerator[StreamEvent, None]:
        prefix.check_request(request, self.fingerprint)
        sink = Sink(asyncio.get_running_loop())
        await self._handoff(lambda: self._admit(request, sink, prefix))
        async with contextlib.aclosing(self._drain(request.call_id, sink)) as events:
            async for event in events:
                yield event

    async def cut(self, call_ids: Sequence[str], *, batch_size: int = CUT_BATCH) -> CutReport:
        """Freeze each call at its current token count, ``batch_size`` calls per hand-off.

        Every hand-off of the cut is queued at once, so they run back to back at the next
        boundary between two units of work: the cut waits for one boundary, not one per batch
        (with vLLM a boundary is a whole step: 16 waits of ~170 ms at 1,000 calls otherwise)."""
        if batch_size < 1:
            raise InvalidInput(f"batch_size must be at least 1, not {batch_size}")
        wanted = list(dict.fromkeys(call_ids))
        batches = [wanted[i : i + batch_size] for i in range(0, len(wanted), batch_size)]
        results = await self._handoffs([partial(self._cut_batch, b) for b in batches])
        prefixes = tuple(self._seal(state) for got, _ in results for state in got)
        refused = tuple(refusal for _, no in results for refusal in no)
        return CutReport(prefixes=prefixes, refused=refused, handoffs=len(batches))

    async def release(self, call_ids: Sequence[str]) -> int:
        """Let frozen calls go on where they were frozen; how many were frozen."""
        return await self._handoff(lambda: self._release(set(call_ids)))

    async def info(self) -> EngineInfo:
        return await self._handoff(self._info)

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights between two units of work; tokens after it carry ``version``."""
        await self._handoff(lambda: self._update(weights, version))

    async def close(self) -> None:
        """Stop the loop; streams still open end with :class:`EngineUnavailable`."""
        with self._closing_lock:
            self._closing = True
            self._commands.put((lambda: None, concurrent.futures.Future()))  # wake the loop
        await asyncio.to_thread(self._thread.join)

    async def __aenter__(self) -> EngineLoop[CallT]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _seal(self, state: Frozen) -> PrefixRecord:
        """Off the loop: a cut's cost on the loop does not grow with digest work."""
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

    # -- for subclasses (run on the loop) -----------------------------------------------------

    def _new_call(self, request: GenerateRequest, sink: Sink) -> CallT:
        raise NotImplementedError

    def _start(self, call: CallT) -> None:
        """The call (fresh, or holding a prefix's tokens) starts generating."""
        raise NotImplementedError

    def _freeze(self, call: CallT) -> None:
        """Stop the call at its token boundary, keeping what it made."""
        call.frozen = True

    def _thaw(self, call: CallT) -> None:
        """A frozen call goes on where it was frozen."""
        call.frozen = False

    def _hold_call(self, call: CallT) -> None:
        """The hold rule stops the call after a token: it waits, generating nothing."""
        call.held = True

    def _unhold(self, call: CallT) -> None:
        """The hold ended for a call it stopped (and no cut froze): it goes on."""
        call.held = False

    def _round(self) -> None:
        raise NotImplementedError

    def _load(self, weights: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def _owning(self) -> Iterator[None]:
        """Around the loop thread's whole life."""
        yield

    def _check_request(self, request: GenerateRequest, prefix: PrefixRecord | None) -> None:
        """Refuse, before anything changes, what this engine cannot run."""
        vocab = self.vocab_size
        tokens = [*request.prompt_tokens, *(prefix.tokens if prefix else ())]
        tokens += request.sampling.allowed_token_ids or ()
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidInput(f"call {request.call_id}: token ids {bad[:5]} outside [0, {vocab})")
        self._check_length(request)

    def _check_length(self, request: GenerateRequest) -> None:
        """Refuse a call that could outgrow the model's context: it would be cut short (or run
        until its caller left, ``max_tokens`` being unbounded otherwise). A resumed prefix is
        within ``max_tokens`` (:class:`PrefixRecord` checks it)."""
        call, context = request.call_id, self.context
        prompt, budget = len(request.prompt_tokens), request.sampling.max_tokens
        if prompt >= context:
            raise InvalidInput(
                f"call {call}: prompt_tokens: {prompt} tokens fill the model's {context} "
                f"positions of context, leaving none to generate"
            )
        if prompt + budget > context:
            raise InvalidInput(
                f"call {call}: sampling.max_tokens: {budget} after a prompt of {prompt} tokens "
                f"exceeds the model's {context} positions of context (at most {context - prompt})"
            )

    def _made(self, call: CallT, token: int, logprob: float, route: Route | None) -> bool:
        """Record and stream one token the call made; whether that ended the call."""
        index = len(call.tokens)
        call.tokens.append(token)
        call.logprobs.append(logprob)
        call.versions.append(self.weight_version)
        if call.routes is not None:
            assert route is not None, f"call {call.call_id}: MoE token {index} has no route"
            call.routes.append(route)
        event = TokenEvent(
            call_id=call.call_id,
            index=index,
            token=token,
            logprob=logprob,
            weight_version=self.weight_version,
            route=route,
        )
        self._emit(call, event)
        params = call.request.sampling
        if token in params.stop_token_ids:
            self._finish(call, "stop")
        elif len(call.tokens) >= params.max_tokens:
            self._finish(call, "length")
        else:
            if self._hold is not None and self._hold.holds(call, self.weight_version):
                self._hold_call(call)
            return False
        return True

    def _finish(self, call: CallT, reason: FinishReason) -> None:
        self._drop(call)
        _remember(self._ended, call.call_id, "finished")
        self._emit(
            call, FinishEvent(call_id=call.call_id, reason=reason, n_tokens=len(call.tokens))
        )

    def _fail(self, call: CallT, detail: str) -> None:
        self._drop(call)
        self._emit(call, EngineUnavailable(detail))

    def _drop(self, call: CallT) -> None:
        """The call leaves the engine (finished, failed, abandoned, superseded)."""
        if self._calls.get(call.call_id) is call:
            del self._calls[call.call_id]

    # -- commands -----------------------------------------------------------------------------

    def _admit(self, request: GenerateRequest, sink: Sink, prefix: PrefixRecord | None) -> None:
        held = self._calls.get(request.call_id)
        # A restored run resumes from its snapshot's prefix while this engine may still hold
        # the call frozen by that snapshot (the run crashed, the engine did not): the resume
        # supersedes the frozen call. A generating call is never replaced.
        if held is not None and not (held.frozen and prefix is not None):
            raise InvalidInput(f"call {request.call_id!r} is already in flight on this engine")
        self._check_request(request, prefix)
        if held is not None:
            self._fail(held, f"call {request.call_id} was frozen and is superseded by a resume")
        call = self._new_call(request, sink)
        if prefix is not None:
            call.cut = True
            call.tokens = list(prefix.tokens)
            call.logprobs = list(prefix.logprobs)
            call.versions = list(prefix.weight_versions)
            if prefix.routes is not None:
                call.routes = list(prefix.routes)
        self._calls[request.call_id] = call
        self._ended.pop(request.call_id, None)
        self._start(call)

    def _cut_batch(self, call_ids: list[str]) -> tuple[list[Frozen], list[CutRefusal]]:
        """Freeze what can be frozen; copy out its state (sealed by :meth:`cut`)."""
        frozen: list[Frozen] = []
        refused: list[CutRefusal] = []
        for call_id in call_ids:
            call = self._calls.get(call_id)
            reason: RefusalReason | None = None
            if call is None:
                reason = self._ended.get(call_id, "not_admitted")
            elif call.request.sampling.allowed_token_ids is not None:
                reason = "constrained_decoding"
            elif not call.tokens:
                reason = "no_tokens"
            if reason is not None or call is None:
                refused.append(CutRefusal(call_id=call_id, reason=reason, detail=REFUSALS[reason]))
                continue
            if not call.frozen:
                self._freeze(call)
            call.cut = True
            call.held = call.held and self._hold is not None and self._hold.keep_cut
            routes = tuple(call.routes) if call.routes is not None else None
            state = (tuple(call.tokens), tuple(call.logprobs), tuple(call.versions), routes)
            frozen.append(Frozen(call.request, *state))
        if frozen and self._hold is not None and self._hold.once:  # ends it for every call
            self._hold = None
            for call in [c for c in self._calls.values() if c.held]:
                self._unhold(call)
        return frozen, refused

    def _release(self, call_ids: set[str]) -> int:
        released = 0
        for call_id in call_ids:
            call = self._calls.get(call_id)
            if call is None or not call.frozen:
                continue
            if call.held:  # keep_cut: its hold outlives the cut; it does not generate
                call.frozen = False
            else:
                self._thaw(call)
            released += 1
        return released

    def _info(self) -> EngineInfo:
        frozen = sum(1 for c in self._calls.values() if c.frozen)
        return EngineInfo(
            model=self.fingerprint,
            kind=self.kind,
            weight_version=self.weight_version,
            active=len(self._calls) - frozen,
            frozen=frozen,
            held=sum(1 for c in self._calls.values() if c.held),
            handoffs=self.handoffs,
        )

    def _update(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        if version <= self.weight_version:
            raise InvalidInput(f"weight version {version} is not newer than {self.weight_version}")
        self._load(weights)
        self.weight_version = version

    def _abandon(self, call_id: str, sink: Sink) -> None:
        # Only this reader's call: a resume may have superseded it under the same id.
        call = self._calls.get(call_id)
        if call is not None and call.sink is sink:
            self._drop(call)
            _remember(self._ended, call_id, "abandoned")

    # -- caller side --------------------------------------------------------------------------

    async def _handoff(self, command: Callable[[], T]) -> T:
        (result,) = await self._handoffs([command])
        return result

    async def _handoffs(self, commands: Sequence[Callable[[], T]]) -> list[T]:
        """Queue ``commands`` together (the loop runs them in order); their results."""
        futures: list[concurrent.futures.Future[T]] = [
            concurrent.futures.Future() for _ in commands
        ]
        # Checked and queued under the lock close() takes: a command is either refused here
        # or queued before the loop's last drain, never left unanswered.
        with self._closing_lock:
            if self._closing:
                raise EngineUnavailable("engine is closed")
            for command, future in zip(commands, futures, strict=True):
                self._commands.put((command, future))
        return [await asyncio.wrap_future(future) for future in futures]

    async def _drain(self, call_id: str, sink: Sink) -> AsyncGenerator[StreamEvent, None]:
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

    # -- the loop -----------------------------------------------------------------------------

    def _loop(self) -> None:
        with self._owning():
            while not self._closing:
                if not any(call.runnable for call in self._calls.values()):
                    self._run_command(self._commands.get())
                    continue
                self._round()
                self._flush()
            for _, future in self._pending_commands():
                future.set_exception(EngineUnavailable("engine closed before the command ran"))
            for call_id, call in list(self._calls.items()):
                self._fail(call, f"engine closed while call {call_id} ran")
            self._flush()

    def _run_pending_commands(self) -> None:
        for item in self._pending_commands():
            self._run_command(item)

    def _pending_commands(self) -> list[Command]:
        """The commands queued now, not those queued while they run: a client sending commands
        back to back must not keep the loop from decoding (each round gets one batch)."""
        items = []
        with self._closing_lock:  # commands a caller queued together are taken together
            for _ in range(self._commands.qsize()):
                try:
                    items.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        return items

    def _run_command(self, item: Command) -> None:
        command, future = item
        self.handoffs += 1
        try:
            future.set_result(command())
        except Exception as exc:  # the caller gets the error; the loop goes on
            future.set_exception(exc)

    def _emit(self, call: CallT, item: StreamEvent | BaseException) -> None:
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


def _remember(memory: OrderedDict[str, T], call_id: str, value: T) -> None:
    memory[call_id] = value
    memory.move_to_end(call_id)
    while len(memory) > REMEMBERED_CALLS:
        memory.popitem(last=False)


def deliver(items: list[tuple[Sink, StreamEvent | BaseException]]) -> None:
    for sink, item in items:
        sink.queue.put_nowait(item)
