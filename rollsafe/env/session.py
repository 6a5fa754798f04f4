"""One episode run's :class:`~rollsafe.env.hooks.EpisodeSession`: where the episode stands
(at a boundary, generating, in a tool call) as its :class:`~rollsafe.env.participant.Participant`
sees it, the places it waits while the instance is parked, and its model calls (built so that
every attempt samples alike, resumed from a restored prefix when the checkpoint cut one), its
effects (once per key: :mod:`rollsafe.env.effects`), and, when the run asks for it, its
:class:`~rollsafe.env.protocol.EpisodeAudit`."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import inspect
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, Literal

from rollsafe.engine.protocol import (
    Completion,
    Engine,
    GenerateRequest,
    PrefixRecord,
    SamplingParams,
    StreamEvent,
    TokenEvent,
    completion_of,
    plain_ints,
    prompt_digest,
)
from rollsafe.env.effects import EffectKey, args_sha256
from rollsafe.env.protocol import (
    CallRecord,
    EffectUse,
    EpisodeAudit,
    EpisodeRef,
    EpisodeResult,
    RunLease,
)

if TYPE_CHECKING:
    from rollsafe.env.hooks import Apply, EnvironmentHooks, OnTokens
    from rollsafe.env.participant import Participant
    from rollsafe.env.participant_records import Restored

# "running": between markers, i.e. neither capturable nor known to be mutating.
Activity = Literal["running", "boundary", "generating", "tool"]


def call_seed(rollout_id: str, turn: int, name: str = "") -> int:
    """The sampling seed of a turn's call: the rollout's, never the attempt's."""
    digest = hashlib.sha256(f"rollsafe-call:{rollout_id}:{turn}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # below 2**63, as SamplingParams wants


class Session:
    """The :class:`~rollsafe.env.hooks.EpisodeSession` of one episode run."""

    def __init__(
        self,
        owner: Participant,
        episode: EpisodeRef,
        restored: Restored | None,
        *,
        audit: bool = False,
        lease: RunLease | None = None,
    ) -> None:
        self.episode, self._owner = episode, owner
        self.lease = lease  # the dispatcher's run lease: checked before each effect
        # A deep copy per run: a run that fails part-way must not change what the retry gets.
        self.restored = None if restored is None else copy.deepcopy(restored.state)
        self.prefixes: Mapping[str, PrefixRecord] = {} if restored is None else restored.prefixes
        self._unused = dict(self.prefixes)  # a prefix resumes one call, once
        self._resumed: dict[str, int] = {}  # call id -> tokens its prefix gave it
        self.activity: Activity = "running"
        self.call_id: str | None = None
        # moved: left the activity prepare reported it parked in, while the checkpoint is open;
        # its state is no longer the one reported, so commit must not export it.
        self.turn, self.moved, self.retired = 0, False, False
        self.first_turn: int | None = None  # the first boundary this run reached
        self.task: asyncio.Task[EpisodeResult] | None = None
        # What env-check compares between attempts; None: the run did not ask for it.
        self.audit: _Audit | None = _Audit() if audit else None

    async def boundary(self, turn: int) -> None:
        self._owner.fence(self)  # a superseded attempt, or its dispatcher gone: stops here
        self.turn = turn
        if self.first_turn is None:
            self.first_turn = turn
        if self.audit is not None:
            digest = self._owner.env.state_digest(self.episode)
            if digest is not None:
                self.audit.state_digests[turn] = digest
        release = self._owner._release
        if release is None:
            return
        self.activity = "boundary"
        self._owner._changed.set()
        await release.wait()  # Participant._close has already set activity back to running
        self._owner.fence(self)  # superseded while parked (by a restore), or its lease ran out

    @asynccontextmanager
    async def generating(self, call_id: str) -> AsyncIterator[None]:
        """While parked, a model response is held here until resume: the episode then still
        stands where prepare reported it (in flight), whether or not the cut froze the call.
        So is a call's failure (its engine died mid-cut): raised only after resume, so the
        commit still finds the episode parked in the call, which a restore makes again."""
        self._mark("generating", call_id)
        if self.audit is not None:
            self.audit.generating += 1
        if self._owner.legacy and call_id in self._unused:
            # The earlier toolkit's environments resume a cut call themselves, under its own
            # id (hooks.LEGACY_RESTORE): counted as resumed, as complete() counts its own.
            self._resumed[call_id] = len(self._unused.pop(call_id).tokens)
        try:
            yield
        except Exception:
            try:
                await self._until_resumed()
            finally:
                self._unmark()
            raise
        except BaseException:  # cancelled (retired): at once
            self._unmark()
            raise
        await self._until_resumed()
        self._unmark()

    async def _until_resumed(self) -> None:
        release = self._owner._release
        if release is not None:
            await release.wait()

    @contextmanager
    def tool(self) -> Iterator[None]:
        self._mark("tool", None)
        try:
            yield
        finally:
            self._unmark()

    def request(
        self,
        turn: int,
        prompt_tokens: Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        name: str = "",
    ) -> GenerateRequest:
        return turn_request(
            self.episode,
            turn,
            prompt_tokens,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=stop_token_ids,
            name=name,
        )

    async def complete(
        self, engine: Engine, request: GenerateRequest, *, on_tokens: OnTokens | None = None
    ) -> Completion:
        prefix = take_prefix(request, self._unused)
        if prefix is not None:
            self._resumed[prefix.call_id] = len(prefix.tokens)
        completion = await complete_call(engine, request, prefix, self.generating, on_tokens)
        if self.audit is not None:
            call = CallRecord(
                call_id=completion.call_id,
                boundary=self.turn,
                prompt_sha256=prompt_digest(request.prompt_tokens),
                tokens=tuple(completion.tokens),
            )
            self.audit.calls.append(call)
        return completion

    async def effect(self, turn: int, name: str, apply: Apply, *, args: Any = None) -> Any:
        key = EffectKey(self.episode.rollout_id, turn, name)
        ledger, digest = self._owner.effects, args_sha256(args)
        async with ledger.held(key):  # an attempt racing for the key waits for the first
            self._owner.fence(self)
            done = ledger.lookup(key, digest)
            if done is None:
                began = self._owner.clock()
                result = apply(key)
                if inspect.isawaitable(result):
                    result = await result
                ledger.record(key, digest, result, self.episode.attempt, began)
            else:
                result = done.result
        if self.audit is not None:
            self.audit.effects.append(EffectUse(turn=turn, name=name, applied=done is None))
        return result

    def resumed_tokens(self, completion: Completion) -> int:
        return self._resumed.get(completion.call_id, 0)

    @property
    def prefix_tokens(self) -> int:
        """Tokens this run's calls took from staged prefixes (what EpisodeResult reports)."""
        return sum(self._resumed.values())

    def _mark(self, activity: Activity, call_id: str | None) -> None:
        self.activity, self.call_id = activity, call_id
        self._owner._changed.set()

    def _unmark(self) -> None:
        self.activity, self.call_id = "running", None
        if self._owner._release is not None:
            self.moved = True
        self._owner._changed.set()


class _Audit:
    """An audited run's effects, calls and state digests, as they happen."""

    def __init__(self) -> None:
        self.effects: list[EffectUse] = []
        self.calls: list[CallRecord] = []
        self.state_digests: dict[int, str] = {}
        self.generating = 0

    def reply(self, env: EnvironmentHooks) -> EpisodeAudit:
        """What was seen, with what ``env`` declares of itself."""
        return EpisodeAudit(
            effects=tuple(self.effects),
            calls=tuple(self.calls),
            generating=self.generating,
            state_digests=dict(self.state_digests),
            side_effects=env.side_effects,
            attempt_info=tuple(env.attempt_info),
        )


def turn_request(
    episode: EpisodeRef,
    turn: int,
    prompt_tokens: Sequence[int],
    *,
    max_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] = (),
    name: str = "",
) -> GenerateRequest:
    """:meth:`EpisodeSession.request <rollsafe.env.hooks.EpisodeSession.request>`."""
    sampling = SamplingParams(
        seed=call_seed(episode.rollout_id, turn, name),
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        stop_token_ids=plain_ints(stop_token_ids),
    )
    call_id = f"{episode.key}/t{turn}" + (f"/{name}" if name else "")
    prompt = plain_ints(prompt_tokens)  # a tokenizer's numpy ints: the request takes ints only
    return GenerateRequest(call_id=call_id, prompt_tokens=prompt, sampling=sampling)


async def complete_call(
    engine: Engine,
    request: GenerateRequest,
    prefix: PrefixRecord | None,
    generating: Callable[[str], AbstractAsyncContextManager[None]],
    on_tokens: OnTokens | None = None,
) -> Completion:
    """:meth:`EpisodeSession.complete <rollsafe.env.hooks.EpisodeSession.complete>`: the call
    inside the session's ``generating``, resumed from ``prefix`` (:func:`take_prefix`) if any,
    its tokens given to ``on_tokens`` as they come (the prefix's first)."""
    if prefix is not None:  # the cut call itself: its id, so the engine's checks pass
        request = request.model_copy(update={"call_id": prefix.call_id})
    async with generating(request.call_id):
        if on_tokens is not None and prefix is not None and prefix.tokens:
            on_tokens(prefix.tokens, prefix.logprobs)
        stream = engine.generate(request) if prefix is None else engine.resume(request, prefix)
        events: list[StreamEvent] = []
        try:
            async for event in stream:
                events.append(event)
                if on_tokens is not None and isinstance(event, TokenEvent):
                    on_tokens((event.token,), (event.logprob,))
        finally:
            # A cancelled episode (retired) ends its call now, not whenever the stream is
            # garbage-collected: the engine frees the call, an HTTP stream its connection.
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
    return completion_of(request.call_id, events, prefix)


def take_prefix(request: GenerateRequest, unused: dict[str, PrefixRecord]) -> PrefixRecord | None:
    """The staged prefix of this very call (same prompt, same sampling), taken out of
    ``unused``: a prefix resumes one call, once."""
    digest = prompt_digest(request.prompt_tokens)
    for call_id, prefix in unused.items():
        if prefix.prompt_digest == digest and prefix.sampling == request.sampling:
            del unused[call_id]
            return prefix
    return None
