"""The episode records a :class:`~rollsafe.env.participant.Participant` commits and restores.

A record is ``{"episode": <EpisodeRef>, "state": <what the environment exported>, "parked":
<where prepare found it: turn, activity, model call>, "effects": [<AppliedEffect>, ...]}``
(the effects applied for the episode's rollout so far, :mod:`rollsafe.env.effects`);
:mod:`rollsafe.env.store` writes and reads them on disk. This module is the part in between:
the records a commit exports through the environment's hooks, the checks a restore applies
to what it read (and to the staged prefixes of cut calls), and the all-or-nothing install of
a restore's scope. ``parked`` is absent from records written before it existed; such a
record is restored with every staged prefix of the restore (a session only uses one whose
prompt and sampling match its call).
``effects`` is absent from records written before effects existed: none.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollsafe.engine.protocol import PrefixRecord
from rollsafe.env.effects import EffectLedger
from rollsafe.env.hooks import EnvironmentHooks
from rollsafe.env.protocol import AppliedEffect, EpisodeRef, ParkedEpisode
from rollsafe.errors import InvalidInput, PrefixMismatch, SnapshotCorrupt
from rollsafe.snapshot.manifest import validation_failure


@dataclass(frozen=True)
class Restored:
    """What a restored attempt continues: the record's state, where its attempt was parked,
    and the staged prefix of the call it was waiting on (by call id), if the checkpoint cut it."""

    state: dict[str, Any]
    parked: ParkedEpisode | None
    prefixes: Mapping[str, PrefixRecord] = field(default_factory=dict)
    effects: tuple[AppliedEffect, ...] = ()


def export_records(
    env: EnvironmentHooks,
    scope: tuple[EpisodeRef, ...],
    parked: Mapping[str, ParkedEpisode],
    effects: EffectLedger,
) -> list[dict[str, Any]]:
    """One record per scope episode, in scope order."""
    return [
        {
            "episode": ep.model_dump(mode="json"),
            "state": env.export_episode(ep),
            "parked": parked[ep.key].model_dump(mode="json", exclude={"episode"}),
            "effects": [e.model_dump(mode="json") for e in effects.of_rollout(ep.rollout_id)],
        }
        for ep in scope
    ]


def confined(path: str, field: str, root: Path | None) -> Path:
    """``path``, absolute (a relative one would land wherever this server happens to run)
    and, when the server has a snapshot ``root`` (real path), inside it once symlinks are
    resolved: a request naming any other place on this machine is refused, whoever holds
    the token."""
    if not Path(path).is_absolute():
        raise InvalidInput(f"{field} must be an absolute path, not {path!r}")
    if root is not None and not Path(os.path.realpath(path)).is_relative_to(root):
        raise InvalidInput(f"{field} {path!r} is outside this server's snapshot root {root}")
    return Path(path)


def restored_in_scope(
    records: list[dict[str, Any]],
    scope: tuple[EpisodeRef, ...],
    root: Path,
    prefixes: Mapping[str, Any],
) -> dict[str, Restored]:
    """Scope episode key -> what its next attempt continues; every scope episode must have a
    record, and every staged prefix handed to one must verify."""
    wanted = {ep.key: ep for ep in scope}
    found: dict[str, Restored] = {}
    for record in records:
        try:
            episode = EpisodeRef.model_validate(record["episode"])
        except (KeyError, ValueError):
            raise SnapshotCorrupt(f"{root}: a record names no valid episode") from None
        if episode.key not in wanted:
            continue
        state, parked = record.get("state"), _parked(record, episode, root)
        if not isinstance(state, dict):
            raise SnapshotCorrupt(f"{root}: the record of {episode.key} holds no state object")
        effects = _effects(record, episode, root)
        found[episode.key] = Restored(state, parked, _prefixes_of(parked, prefixes), effects)
    missing = sorted(wanted.keys() - found.keys())
    if missing:
        raise SnapshotCorrupt(f"{root}: no record for {', '.join(missing)}; nothing restored")
    return found


def _parked(record: dict[str, Any], episode: EpisodeRef, root: Path) -> ParkedEpisode | None:
    raw = record.get("parked")
    if raw is None:
        return None
    try:
        return ParkedEpisode.model_validate({**raw, "episode": episode.model_dump(mode="json")})
    except (TypeError, ValidationError) as exc:
        raise SnapshotCorrupt(f"{root}: the record of {episode.key}: bad parked: {exc}") from None


def _effects(record: dict[str, Any], episode: EpisodeRef, root: Path) -> tuple[AppliedEffect, ...]:
    raw = record.get("effects", [])
    try:
        return tuple(AppliedEffect.model_validate(e) for e in raw)
    except (TypeError, ValidationError) as exc:
        raise SnapshotCorrupt(f"{root}: the record of {episode.key}: bad effects: {exc}") from None


def _prefixes_of(
    parked: ParkedEpisode | None, staged: Mapping[str, Any]
) -> dict[str, PrefixRecord]:
    """The staged prefixes that belong to this episode, each parsed and digest-checked."""
    if parked is None:
        names = list(staged)
    elif parked.model_call_id is not None and parked.model_call_id in staged:
        names = [parked.model_call_id]
    else:
        names = []
    checked = {}
    for call_id in names:
        where = f"staged prefix of call {call_id}"
        try:
            prefix = PrefixRecord.model_validate(staged[call_id])
            if prefix.call_id != call_id:
                raise PrefixMismatch(call_id, "call_id", f"record is for {prefix.call_id!r}")
            prefix.verify()
        except ValidationError as exc:
            raise validation_failure(exc, where) from None
        except PrefixMismatch as exc:
            raise SnapshotCorrupt(f"{where}: {exc}") from None
        checked[call_id] = prefix
    return checked


def install(
    env: EnvironmentHooks,
    scope: tuple[EpisodeRef, ...],
    restored: Mapping[str, Restored],
    *,
    legacy: bool = False,
) -> None:
    """Let the environment check each scope episode's record (``restore_episode``), all or
    nothing: a refused record drops every episode this call installed. ``legacy``: it has the
    earlier three-argument ``restore_episode`` (:data:`~rollsafe.env.hooks.LEGACY_RESTORE`)."""
    done: list[EpisodeRef] = []
    for ep in scope:
        try:
            done.append(ep)  # before: a half-installed record is dropped too
            record = restored[ep.key]
            if legacy:  # the earlier signature, for one release (hooks.LEGACY_RESTORE)
                prefixes = {c: p.model_dump(mode="json") for c, p in record.prefixes.items()}
                env.restore_episode(ep, record.state, prefixes)  # type: ignore[call-arg]
            else:
                env.restore_episode(ep, record.state)
        except Exception as exc:
            for installed in done:
                env.drop_episode(installed.next_attempt())
            raise SnapshotCorrupt(
                f"{env.name} refused the record of {ep.key}: {exc}; nothing restored"
            ) from exc
