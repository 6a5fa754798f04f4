"""The workplace environment's hooks: episodes, export, record checks.

Per turn: a prompt from the task and the actions so far, one policy call (the toolkit's
``session.request``: call id ``<episode key>/t<turn>``, sampling seeded from the rollout and
the turn only, so a restored attempt makes the same call), the tokens mapped to a valid
calendar action, the action applied once per ``(rollout_id, turn, call_id)``, then a boundary.

A restored episode continues from its record's turn (``session.restored``). A call that was
in flight is made again through ``session.complete``: resumed from its cut's prefix when the
checkpoint staged one (the prefix's tokens are kept, never regenerated), otherwise generated
again under this attempt's call id, which cannot collide with the old call if an engine still
holds it; the same seed and prompt make the same tokens on the same weights.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rollsafe.engine.protocol import Engine
from rollsafe.env.hooks import EnvironmentHooks, EpisodeSession
from rollsafe.env.protocol import EpisodeRef, EpisodeResult, RunEpisode
from rollsafe.errors import InvalidInput
from rollsafe.reference.envs.workplace.calendar import (
    action_from_tokens,
    apply,
    new_calendar,
    parse_task,
)
from rollsafe.reference.envs.workplace.calendar import prompt as make_prompt
from rollsafe.reference.envs.workplace.calendar import reward as score
from rollsafe.reference.envs.workplace.record import EpisodeRecord, InFlight, TurnLog, parse_record


class WorkplaceEnv(EnvironmentHooks):
    name = "workplace"
    kind = "environment"
    side_effects = False  # the calendar is the episode's own state, exported with it

    def __init__(self, engine: Engine, *, max_tokens: int = 12, temperature: float = 1.0) -> None:
        self.engine = engine
        self.max_tokens = max_tokens
        self.temperature = temperature
        self._live: dict[str, EpisodeRecord] = {}  # by episode key: what export_episode dumps

    # -- hooks ----------------------------------------------------------------------------------

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        episode = session.episode
        task = parse_task(run.task)  # a bad task is refused even when a record takes over
        state = self._start(episode, session.restored)
        if state is None:
            state = EpisodeRecord(episode=episode, task=task, turn=0, calendar=new_calendar(task))
        self._live[episode.key] = state
        try:
            if state.in_flight is None:
                await session.boundary(state.turn)
            while state.turn < state.task.turns:
                state = await self._turn(session, state)
                await session.boundary(state.turn)
        finally:
            self._live.pop(episode.key, None)
        return EpisodeResult(
            episode=episode,
            reward=score(state.calendar, state.task),
            turns=state.turn,
            restored=False,  # the toolkit says whether it was
            info={
                "mutations": [
                    m.model_dump(mode="json", exclude={"rollout_id"})
                    for m in state.calendar.mutations
                ],
                "calendar": [e.model_dump(mode="json") for e in state.calendar.events],
                "history": [
                    h.model_dump(mode="json", exclude={"resumed_from"}) for h in state.history
                ],
                # About this attempt, not the episode (env-check compares all but this).
                "attempt": {
                    "resumed_from": {
                        h.call_id: h.resumed_from for h in state.history if h.resumed_from
                    }
                },
            },
        )

    def export_episode(self, episode: EpisodeRef) -> dict[str, Any]:
        state = self._live.get(episode.key)
        if state is None:
            raise InvalidInput(f"workplace holds no live episode {episode.key}")
        return state.model_dump(mode="json")

    def restore_episode(self, episode: EpisodeRef, record: dict[str, Any]) -> None:
        state = parse_record(record)
        if state.episode != episode:
            raise InvalidInput(f"record is for {state.episode.key}, not {episode.key}")

    def state_digest(self, episode: EpisodeRef) -> str | None:
        """The calendar, the turn and every turn's tokens: the whole state but the call ids
        and resumed counts, which name the attempt."""
        state = self._live[episode.key]
        whole = {
            "task": state.task.model_dump(mode="json"),
            "turn": state.turn,
            "calendar": state.calendar.model_dump(mode="json", exclude={"mutations"}),
            "mutations": [
                m.model_dump(mode="json", exclude={"call_id"}) for m in state.calendar.mutations
            ],
            "tokens": [list(h.tokens) for h in state.history],
        }
        return hashlib.sha256(json.dumps(whole, sort_keys=True).encode()).hexdigest()

    def drop_episode(self, episode: EpisodeRef) -> None:
        self._live.pop(episode.key, None)

    # -- episode steps --------------------------------------------------------------------------

    def _start(self, episode: EpisodeRef, restored: dict[str, Any] | None) -> EpisodeRecord | None:
        """The state a restored attempt continues from (None: a fresh episode)."""
        if restored is None:
            return None
        record = parse_record(restored)
        if record.episode.next_attempt() != episode:
            raise InvalidInput(f"record of {record.episode.key} does not continue {episode.key}")
        return record.model_copy(update={"episode": episode})

    async def _turn(self, session: EpisodeSession, state: EpisodeRecord) -> EpisodeRecord:
        """One policy call and its tool call; returns the state at the next boundary."""
        key = session.episode.key
        request = session.request(
            state.turn,
            make_prompt(state.task, state.calendar, state.turn),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
        )
        state = state.model_copy(
            update={"in_flight": InFlight(call_id=request.call_id, request=request)}
        )
        self._live[key] = state
        completion = await session.complete(self.engine, request)
        with session.tool():
            action = action_from_tokens(completion.tokens, state.calendar)
            calendar = apply(
                state.calendar,
                action,
                rollout_id=state.episode.rollout_id,
                turn=state.turn,
                call_id=completion.call_id,
            )
            log = TurnLog(
                turn=state.turn,
                call_id=completion.call_id,
                tokens=completion.tokens,
                resumed_from=session.resumed_tokens(completion),
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
