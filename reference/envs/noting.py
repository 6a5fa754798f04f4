"""FrozenLake noting in its result's info which attempt finished each episode: a field about
the attempt, not the episode, kept outside ``info["attempt"]`` (as third-party environments
do). :class:`AttemptNotingLake` declares it (``attempt_info``) and passes ``rollsafe
env-check``; without the declaration a restored attempt's ``info.finished[0].attempt: 1 != 0``
fails ``restore``."""

from __future__ import annotations

from rollsafe.env.hooks import EpisodeSession
from rollsafe.env.protocol import EpisodeResult, RunEpisode
from rollsafe.reference.envs.frozen_lake import FrozenLake


class AttemptNotingLake(FrozenLake):
    name = "attempt_noting_lake"
    attempt_info = ("finished[].attempt",)

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        result = await super().run_episode(run, session)
        finished = [{"turn": result.turns, "attempt": session.episode.attempt}]
        return result.model_copy(update={"info": {**result.info, "finished": finished}})
