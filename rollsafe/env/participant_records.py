"""The episode records a :class:`~rollsafe.env.participant.Participant` commits and restores.

A record is ``{"episode": <EpisodeRef>, "state": <what the environment exported>}``;
:mod:`rollsafe.env.store` writes and reads them on disk. This module is the part in between:
the records a commit exports through the environment's hooks, the checks a restore applies to
what it read, and the all-or-nothing install of a restore's scope.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollsafe.env.hooks import EnvironmentHooks
from rollsafe.env.protocol import EpisodeRef
from rollsafe.errors import InvalidInput, SnapshotCorrupt


def export_records(env: EnvironmentHooks, scope: tuple[EpisodeRef, ...]) -> list[dict[str, Any]]:
    """One record per scope episode, in scope order."""
    return [
        {"episode": ep.model_dump(mode="json"), "state": env.export_episode(ep)} for ep in scope
    ]


def absolute(path: str, field: str) -> Path:
    # A relative path would land wherever this server happens to run.
    if not Path(path).is_absolute():
        raise InvalidInput(f"{field} must be an absolute path, not {path!r}")
    return Path(path)


def states_in_scope(
    records: list[dict[str, Any]], scope: tuple[EpisodeRef, ...], root: Path
) -> dict[str, dict[str, Any]]:
    """Scope episode key -> state; every scope episode must have a record."""
    wanted = {ep.key for ep in scope}
    states: dict[str, dict[str, Any]] = {}
    for record in records:
        try:
            key = EpisodeRef.model_validate(record["episode"]).key
        except ValueError:
            raise SnapshotCorrupt(f"{root}: a record names no valid episode") from None
        if key in wanted:
            if not isinstance(record.get("state"), dict):
                raise SnapshotCorrupt(f"{root}: the record of {key} holds no state object")
            states[key] = record["state"]
    missing = sorted(wanted - states.keys())
    if missing:
        raise SnapshotCorrupt(f"{root}: no record for {', '.join(missing)}; nothing restored")
    return states


def install(
    env: EnvironmentHooks,
    scope: tuple[EpisodeRef, ...],
    states: dict[str, dict[str, Any]],
    prefixes: dict[str, Any],
) -> None:
    """Each scope episode's state as its next attempt, all or nothing: a refused record drops
    every episode this call installed."""
    done: list[EpisodeRef] = []
    for ep in scope:
        try:
            done.append(ep)  # before: a half-installed record is dropped too
            env.restore_episode(ep, states[ep.key], prefixes)
        except Exception as exc:
            for installed in done:
                env.drop_episode(installed.next_attempt())
            raise SnapshotCorrupt(
                f"{env.name} refused the record of {ep.key}: {exc}; nothing restored"
            ) from exc
