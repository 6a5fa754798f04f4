"""Deliberately broken environments, for the conformance tests: the FrozenLake example with its
checkpoint support broken the way a careless port breaks it. ``rollsafe env-check`` must fail
each.

- :class:`LossyFrozenLake` exports nothing, and a restored attempt starts again from turn 0
  (applying the first turns' moves twice) while the toolkit still reports it restored.
- :class:`RegeneratingFrozenLake` continues its record, but makes a cut call again from its
  first token instead of resuming it from the staged prefix.

And textarena's Mastermind (:mod:`rollsafe.reference.envs.mastermind`) broken where exactly
once breaks without moving the turns or the reward:

- :class:`ResubmittingMastermind` names its submit effect after the episode (the attempt
  included), so a restored attempt submits the guesses of the turns it redoes again.
- :class:`ForgetfulMastermind` does not replay the record's guesses into the restored game:
  textarena's own history and turn counter (hidden state) are lost; pegs and reward are not.
- :class:`RowChangingMastermind` reports the guesses its run made, not the record's: a
  restored episode yields a shorter training row.
"""

from __future__ import annotations

from typing import Any

from rollsafe.engine.protocol import Completion, Engine, GenerateRequest
from rollsafe.env.hooks import Apply, EpisodeSession
from rollsafe.env.protocol import EpisodeRef, EpisodeResult, RunEpisode
from rollsafe.env.session import complete_call
from rollsafe.reference.envs.frozen_lake import FrozenLake
from rollsafe.reference.envs.mastermind import Game, Mastermind, new_game, parsed


class _Forgetful:
    """A session that hides its restored record from the environment."""

    restored = None

    def __init__(self, session: EpisodeSession) -> None:
        self._session = session

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


class _NoResume(_Forgetful):
    """A session that makes every call from scratch, staged prefix or not."""

    def __init__(self, session: EpisodeSession) -> None:
        super().__init__(session)
        self.restored = session.restored  # type: ignore[assignment]

    async def complete(self, engine: Engine, request: GenerateRequest) -> Completion:
        return await complete_call(engine, request, None, self._session.generating)


class LossyFrozenLake(FrozenLake):
    name = "lossy_frozen_lake"

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        return await super().run_episode(run, _Forgetful(session))  # type: ignore[arg-type]

    def export_episode(self, episode: EpisodeRef) -> dict[str, Any]:
        return {}


class RegeneratingFrozenLake(FrozenLake):
    name = "regenerating_frozen_lake"

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        return await super().run_episode(run, _NoResume(session))  # type: ignore[arg-type]


class _AttemptKeyed(_Forgetful):
    """A session whose effects are named after the episode key, the attempt included."""

    def __init__(self, session: EpisodeSession) -> None:
        super().__init__(session)
        self.restored = session.restored  # type: ignore[assignment]

    async def effect(self, turn: int, name: str, apply: Apply, *, args: Any = None) -> Any:
        named = f"{name}@{self._session.episode.key}"
        return await self._session.effect(turn, named, apply, args=args)


class ResubmittingMastermind(Mastermind):
    name = "resubmitting_mastermind"

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        return await super().run_episode(run, _AttemptKeyed(session))  # type: ignore[arg-type]


class ForgetfulMastermind(Mastermind):
    name = "forgetful_mastermind"

    def resume_game(self, game: Game) -> Any:
        return new_game(game.seed)  # the record's guesses are not replayed into textarena


class RowChangingMastermind(Mastermind):
    name = "row_changing_mastermind"

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        result = await super().run_episode(run, session)
        record = session.restored
        made_before = len(parsed(Game, record).guesses) if record else 0
        guesses = result.info["guesses"][made_before:]  # this run's guesses only
        return result.model_copy(update={"info": {"guesses": guesses}})
