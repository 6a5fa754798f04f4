"""Deliberately broken environments, for the conformance tests: the FrozenLake example with its
checkpoint support broken the way a careless port breaks it. ``rollsafe env-check`` must fail
each.

- :class:`LossyFrozenLake` exports nothing, and a restored attempt starts again from turn 0
  (applying the first turns' moves twice) while the toolkit still reports it restored.
- :class:`RegeneratingFrozenLake` continues its record, but makes a cut call again from its
  first token instead of resuming it from the staged prefix.
"""

from __future__ import annotations

from typing import Any

from rollsafe.engine.protocol import Completion, Engine, GenerateRequest
from rollsafe.env.hooks import EpisodeSession
from rollsafe.env.protocol import EpisodeRef, EpisodeResult, RunEpisode
from rollsafe.env.session import complete_call
from rollsafe.reference.envs.frozen_lake import FrozenLake


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
