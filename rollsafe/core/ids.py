"""Identities of a run and their wire keys (docs/design.md section 2).

- run id: ``[A-Za-z0-9._-]{1,64}``
- group id: ``f"{run_id}-{idx}"`` for the group handed out at dataset index ``idx``
- rollout id: ``f"{group_id}_g{i}"``; a rollout's training row key, fixed for its life
- episode: ``(rollout_id, attempt)``; wire key ``rollout_id`` for attempt 0, else
  ``f"{rollout_id}-a{attempt}"``. A rollout id always ends in ``_g<i>``, never in ``-a<n>``,
  so the wire key is injective and parses back unambiguously.

Group ids are derived from the run and the dataset index rather than minted at random: the
same handout after a restore gets the same id, so every row key is stable across restarts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rollsafe.errors import InvalidInput

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
_ROLLOUT_RE = re.compile(
    r"(?P<run>[A-Za-z0-9._-]{1,64})-(?P<idx>0|[1-9][0-9]*)_g(?P<i>0|[1-9][0-9]*)"
)
_EPISODE_RE = re.compile(r"(?P<rollout>.+?_g(?:0|[1-9][0-9]*))(?:-a(?P<attempt>[1-9][0-9]*))?")


def validate_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise InvalidInput(f"invalid run id {run_id!r}: expected [A-Za-z0-9._-]{{1,64}}")
    return run_id


def _non_negative(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"invalid {name} {value!r}: expected an integer >= 0")
    return value


@dataclass(frozen=True, slots=True)
class GroupId:
    run_id: str
    idx: int

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        _non_negative("dataset index", self.idx)

    @property
    def key(self) -> str:
        return f"{self.run_id}-{self.idx}"

    def rollout(self, i: int) -> RolloutId:
        return RolloutId(self, i)

    def __str__(self) -> str:
        return self.key


def rollout_key(run_id: str, idx: int, i: int) -> str:
    """:attr:`RolloutId.key` without building (and validating) the ids: for keys made by the
    million from columns already checked."""
    return f"{run_id}-{idx}_g{i}"


@dataclass(frozen=True, slots=True)
class RolloutId:
    group: GroupId
    i: int

    def __post_init__(self) -> None:
        _non_negative("sibling index", self.i)

    @property
    def key(self) -> str:
        return rollout_key(self.group.run_id, self.group.idx, self.i)

    @classmethod
    def parse(cls, key: str) -> RolloutId:
        match = _ROLLOUT_RE.fullmatch(key)
        if match is None:
            raise InvalidInput(f"invalid rollout id {key!r}: expected <run_id>-<idx>_g<i>")
        return cls(GroupId(match["run"], int(match["idx"])), int(match["i"]))

    def episode(self, attempt: int) -> EpisodeId:
        return EpisodeId(self, attempt)

    def __str__(self) -> str:
        return self.key


@dataclass(frozen=True, slots=True)
class EpisodeId:
    """One attempt's life inside an environment."""

    rollout: RolloutId
    attempt: int

    def __post_init__(self) -> None:
        _non_negative("attempt", self.attempt)

    @property
    def key(self) -> str:
        if self.attempt == 0:
            return self.rollout.key
        return f"{self.rollout.key}-a{self.attempt}"

    @classmethod
    def parse(cls, key: str) -> EpisodeId:
        match = _EPISODE_RE.fullmatch(key)
        if match is None:
            raise InvalidInput(f"invalid episode key {key!r}: expected <rollout_id>[-a<n>]")
        attempt = int(match["attempt"]) if match["attempt"] else 0
        return cls(RolloutId.parse(match["rollout"]), attempt)

    def __str__(self) -> str:
        return self.key


# ---- a run's checkpoints: every name of one, minted here and nowhere else -----------------


def task_queue_for(run_id: str) -> str:
    """The default task queue of a run's checkpoint workers."""
    return f"rollsafe.{run_id}"


def supervisor_id(run_id: str) -> str:
    """The workflow id of the run's snapshot supervisor (one per run)."""
    return f"rollsafe/{run_id}"


def snapshot_workflow_id(run_id: str, seq: int) -> str:
    """The workflow id of the run's snapshot ``seq`` (a child of its supervisor)."""
    return f"rollsafe/{run_id}/snapshot/{seq}"


def restore_workflow_id(run_id: str, restore_id: str) -> str:
    """The workflow id of one restore of the run."""
    return f"rollsafe/{run_id}/restore/{restore_id}"


def checkpoint_id_for(run_id: str, seq: int, kind: str) -> str:
    """The checkpoint id of snapshot ``seq``: minted from the workflow's input, never at
    random, so a retried activity or a replayed workflow names the same checkpoint."""
    return f"{run_id}.{kind}.{seq:08d}"


def snapshot_dir_name(seq: int, kind: str) -> str:
    """The directory (or object prefix) a published snapshot ``seq`` lives under."""
    return f"{seq:08d}-{kind}"
