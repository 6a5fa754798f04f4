"""Environment hooks for tests of the protocol alone, and reading ``rollsafe env-check``'s
output."""

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


def failed_checks(stdout: str) -> dict[str, str]:
    """``rollsafe env-check``'s ``FAIL <check> (<s>s): <detail>`` lines, by check name."""
    lines = [line.split(" ", 2) for line in stdout.splitlines() if line.startswith("FAIL ")]
    return {name: detail for _, name, detail in lines}
