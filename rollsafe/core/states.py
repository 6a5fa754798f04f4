"""The state machines of docs/design.md section 2, as data: states, legal transitions, restore
levels.

The attempt machine is driven by the ledger, the group machine by the replay index; both
modules check every move against the tables here, so the rules live in one place.
"""

from __future__ import annotations

from enum import IntEnum

from rollsafe.errors import IllegalTransition


class AttemptState(IntEnum):
    RESERVED = 0
    DISPATCHED = 1
    SEALED = 2
    FAILED = 3
    ABANDONED = 4


class GroupState(IntEnum):
    RESERVED = 0
    GENERATING = 1
    READY = 2
    CLAIMED = 3
    TRAINED = 4
    EVICTED = 5


class RestoreLevel(IntEnum):
    """How finely an unfinished rollout resumes; larger is finer. Falls back to coarser."""

    PROMPT_GROUP = 0
    SIBLING = 1
    TURN = 2
    PREFIX = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> RestoreLevel:
        try:
            return cls[text.upper()]
        except KeyError:
            choices = ", ".join(level.label for level in cls)
            raise ValueError(f"unknown restore level {text!r} (choose from {choices})") from None


_A = AttemptState
ATTEMPT_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    _A.RESERVED: frozenset({_A.DISPATCHED, _A.ABANDONED}),
    # DISPATCHED -> RESERVED is a refused dispatch: same attempt, nothing spent.
    _A.DISPATCHED: frozenset({_A.RESERVED, _A.SEALED, _A.FAILED, _A.ABANDONED}),
    # A sealed rollout is abandoned only when its whole prompt group restarts.
    _A.SEALED: frozenset({_A.ABANDONED}),
    # FAILED / ABANDONED -> RESERVED is a retry: a new attempt of the same rollout.
    _A.FAILED: frozenset({_A.RESERVED, _A.ABANDONED}),
    _A.ABANDONED: frozenset({_A.RESERVED}),
}

_G = GroupState
GROUP_TRANSITIONS: dict[GroupState, frozenset[GroupState]] = {
    _G.RESERVED: frozenset({_G.GENERATING, _G.EVICTED}),
    _G.GENERATING: frozenset({_G.READY, _G.EVICTED}),
    _G.READY: frozenset({_G.CLAIMED, _G.TRAINED, _G.EVICTED}),
    # CLAIMED -> READY: the step never committed (released claim, or restore).
    _G.CLAIMED: frozenset({_G.TRAINED, _G.READY}),
    _G.TRAINED: frozenset(),
    _G.EVICTED: frozenset(),
}


def check_attempt(subject: str, operation: str, current: int, target: AttemptState) -> None:
    if target not in ATTEMPT_TRANSITIONS[AttemptState(current)]:
        raise IllegalTransition(subject, operation, AttemptState(current).name, target.name)


def check_group(subject: str, operation: str, current: int, target: GroupState) -> None:
    if target not in GROUP_TRANSITIONS[GroupState(current)]:
        raise IllegalTransition(subject, operation, GroupState(current).name, target.name)


class RecordKind(IntEnum):
    """What changed: one operation of the run (:class:`rollsafe.core.run_state.RunState`), or
    the restart a restore applied (RESTART: abandons, retries, claims released)."""

    HANDOUT = 1
    DISPATCH = 2
    SEAL = 3
    CLAIM = 4
    COMMIT = 5
    EVICT = 6
    RESTART = 7
    WEIGHT_VERSION = 8
