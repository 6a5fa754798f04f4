"""The workplace environment's hooks: episodes, export, restore.

Per turn: a prompt from the task and the actions so far, one policy call
(``<episode key>/t<turn>``, sampling seeded from ``(rollout_id, turn)`` only, so a restored
attempt makes the same call), the tokens mapped to a valid calendar action, the action applied
once per ``(rollout_id, turn, call_id)``, then a boundary.

A restored episode continues from its record's turn. A call that was in flight is resumed
from its cut's prefix record when the restore got one (the prefix's tokens are kept, never
regenerated); without one it is generated again under this attempt's call id: the same seed
and prompt make the same tokens on the same weights, and a fresh id cannot collide with the
old call if an engine still holds it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from reference.envs.workplace.calendar import action_from_tokens, apply, new_calendar, parse_task
from reference.envs.workplace.calendar import prompt as make_prompt
from reference.envs.workplace.calendar import reward as score
from reference.envs.workplace.record import EpisodeRecord, InFlight, TurnLog, parse_record
from rollsafe.engine.protocol import (
    Completion,
    Engine,
    GenerateRequest,
    PrefixRecord,
    SamplingParams,
    completion_of,
)
from rollsafe.env.hooks import EnvironmentHooks, EpisodeSession
from rollsafe.env.protocol import EpisodeRef, EpisodeResult, RunEpisode
from rollsafe.errors import InvalidInput, RollsafeError


def call_seed(rollout_id: str, turn: int) -> int:
    """The sampling seed of a turn's call: not the attempt's, so every attempt samples alike."""
    digest = hashlib.sha256(f"workplace-call:{rollout_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # below 2**63, as SamplingParams wants


@dataclass(frozen=True)
class _Restored:
    record: EpisodeRecord
    prefix: PrefixRecord | None  # the cut of record.in_flight, when the checkpoint had one


class WorkplaceEnv(EnvironmentHooks):
    name = "workplace"
    kind = "environment"

    def __init__(self, engine: Engine, *, max_tokens: int = 12, temperature: float = 1.0) -> None:
        self.engine = engine
        self.max_tokens = max_tokens
        self.temperature = temperature
        self._live: dict[str, EpisodeRecord] = {}  # by episode key: what export_episode dumps
        self._restored: dict[str, _Restored] = {}  # by the key of the attempt that continues

    # -- hooks ----------------------------------------------------------------------------------

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        episode = session.episode
        task = parse_task(run.task)  # a bad task is refused even when a record takes over
        state, prefix = self._start(episode, session.restored)
        if state is None:
            state = EpisodeRecord(episode=episode, task=task, turn=0, calendar=new_calendar(task))
        self._live[episode.key] = state
        try:
            if state.in_flight is None:
                await session.boundary(state.turn)
            while state.turn < state.task.turns:
                state = await self._turn(session, state, prefix)
                prefix = None
                await session.boundary(state.turn)
        finally:
            self._live.pop(episode.key, None)
        self._restored.pop(episode.key, None)
        return EpisodeResult(
            episode=episode,
            reward=score(state.calendar, state.task),
            turns=state.turn,
            restored=session.restored is not None,
            info={
                "mutations": [
                    m.model_dump(mode="json", exclude={"rollout_id"})
                    for m in state.calendar.mutations
                ],
                "calendar": [e.model_dump(mode="json") for e in state.calendar.events],
                "history": [h.model_dump(mode="json") for h in state.history],
            },
        )

    def export_episode(self, episode: EpisodeRef) -> dict[str, Any]:
        state = self._live.get(episode.key)
        if state is None:
            raise InvalidInput(f"workplace holds no live episode {episode.key}")
        return state.model_dump(mode="json")

    def restore_episode(
        self, episode: EpisodeRef, record: dict[str, Any], prefixes: dict[str, Any]
    ) -> None:
        state = parse_record(record)
        if state.episode != episode:
            raise InvalidInput(f"record is for {state.episode.key}, not {episode.key}")
        prefix = None
        if state.in_flight is not None and state.in_flight.call_id in prefixes:
            prefix = _checked_prefix(state.in_flight, prefixes[state.in_flight.call_id])
        self._restored[episode.next_attempt().key] = _Restored(state, prefix)

    def drop_episode(self, episode: EpisodeRef) -> None:
        self._live.pop(episode.key, None)
        self._restored.pop(episode.key, None)

    # -- episode steps --------------------------------------------------------------------------

    def _start(
        self, episode: EpisodeRef, restored: dict[str, Any] | None
    ) -> tuple[EpisodeRecord | None, PrefixRecord | None]:
        """The state a restored attempt continues from (None: a fresh episode), and the prefix
        of its in-flight call if the checkpoint cut one."""
        if restored is None:
            return None, None
        record = parse_record(restored)
        if record.episode.next_attempt() != episode:
            raise InvalidInput(f"record of {record.episode.key} does not continue {episode.key}")
        held = self._restored.get(episode.key)
        prefix = held.prefix if held is not None and held.record == record else None
        return record.model_copy(update={"episode": episode}), prefix

    async def _turn(
        self, session: EpisodeSession, state: EpisodeRecord, prefix: PrefixRecord | None
    ) -> EpisodeRecord:
        """One policy call and its tool call; returns the state at the next boundary."""
        key = session.episode.key
        call_id = f"{key}/t{state.turn}"
        if state.in_flight is None or (prefix is None and state.in_flight.call_id != call_id):
            request = GenerateRequest(
                call_id=call_id,
                prompt_tokens=make_prompt(state.task, state.calendar, state.turn),
                sampling=SamplingParams(
                    seed=call_seed(state.episode.rollout_id, state.turn),
                    temperature=self.temperature,
                    max_tokens=self.max_tokens,
                ),
            )
            state = state.model_copy(
                update={"in_flight": InFlight(call_id=call_id, request=request)}
            )
            self._live[key] = state
        assert state.in_flight is not None
        request = state.in_flight.request
        async with session.generating(request.call_id):
            completion = await self._complete(request, prefix)
        with session.tool():
            action = action_from_tokens(completion.tokens, state.calendar)
            calendar = apply(
                state.calendar,
                action,
                rollout_id=state.episode.rollout_id,
                turn=state.turn,
                call_id=request.call_id,
            )
            log = TurnLog(
                turn=state.turn,
                call_id=request.call_id,
                tokens=completion.tokens,
                resumed_from=len(prefix.tokens) if prefix is not None else 0,
            )
            state = state.model_copy(
                update={
                    "turn": state.turn + 1,
                    "calendar": calendar,
                    "history": (*state.history, log),
                    "in_flight": None,
                }
            )
            self._live[key] = state
        return state

    async def _complete(self, request: GenerateRequest, prefix: PrefixRecord | None) -> Completion:
        if prefix is None:
            stream = self.engine.generate(request)
        else:
            stream = self.engine.resume(request, prefix)
        try:
            events = [e async for e in stream]
        finally:
            # A cancelled episode (retired) ends its call now, not whenever the stream is
            # garbage-collected: the engine frees the call, an HTTP stream its connection.
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        return completion_of(request.call_id, events, prefix)


def _checked_prefix(in_flight: InFlight, raw: Any) -> PrefixRecord:
    """The staged prefix of ``in_flight``, refused now (not at resume) if it cannot continue it."""
    try:
        prefix = PrefixRecord.model_validate(raw)
        # The engine checks its model fingerprint at resume; everything else is checked here.
        prefix.check_request(in_flight.request, prefix.model)
    except (ValueError, RollsafeError) as exc:
        raise InvalidInput(f"prefix for {in_flight.call_id}: {exc}") from None
    return prefix
