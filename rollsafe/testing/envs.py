"""Environment hooks for tests of the protocol alone."""

from __future__ import annotations

from typing import Any

from rollsafe.env.hooks import EnvironmentHooks


class Idle(EnvironmentHooks):
    """An environment with no episodes: the checkpoint protocol alone."""

    name = "idle"

    async def run_episode(self, run: Any, session: Any) -> Any:
        raise NotImplementedError("an idle environment runs no episode")

    def export_episode(self, episode: Any) -> dict[str, Any]:
        return {}

    def drop_episode(self, episode: Any) -> None:
        return None
