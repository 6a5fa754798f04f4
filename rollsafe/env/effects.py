"""Effects outside an environment's state, applied once per key across attempts and restores.

An *effect* is what an episode does to the world outside the state ``export_episode`` writes:
a guess submitted to a ledger, a row inserted, a message sent. A restored attempt redoes the
turns after its record's boundary, and an abandoned attempt (its trainer died) may still be
running: an effect made directly would be applied twice. Made through
:meth:`EpisodeSession.effect <rollsafe.env.hooks.EpisodeSession.effect>`, it runs at most once
per :class:`EffectKey` ``(rollout, turn, name)`` on the instance: a later call with the key,
from any attempt, gets the first one's recorded result without running it (its arguments
must be the same, else :class:`~rollsafe.errors.EffectDiverged`). And each rollout has one
*current* attempt on the instance, the one last run or restored there: any other is
*superseded*, refused before each effect and at each boundary, so an abandoned attempt stops
there. The last one, not the highest: a run restored from an older snapshot (a step rolled
back) numbers its attempts from that snapshot again, and those are the ones that count.

The :class:`EffectLedger` is this module: pure bookkeeping, no I/O. A commit writes each
episode's rollout's entries into its record and a restore installs them, so an instance that
restores an episode it never ran still answers the effects applied before the checkpoint.
What no ledger can know is an effect applied after the checkpoint by an attempt whose instance
was lost too: ``apply`` is given the key (:attr:`EffectKey.id`) for that, and the system it
writes to must drop a second write of the same key (docs/environment-protocol.md, "Effects").
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from rollsafe.env.protocol import EFFECT_NAME_PATTERN, AppliedEffect, EpisodeRef
from rollsafe.errors import EffectDiverged, InvalidInput, ParticipantRefused
from rollsafe.snapshot.manifest import canonical_sha256

# Rollouts whose effects and current attempt an instance remembers; the least recently touched
# beyond it are forgotten (a rollout's episodes run within hours; 100k rollouts of a few effects
# each are some tens of MB). A forgotten rollout's effects come back with a restore's records.
MAX_ROLLOUTS = 100_000


@dataclass(frozen=True)
class EffectKey:
    """An effect's idempotency key: the rollout (never the attempt), the turn, a name."""

    rollout_id: str
    turn: int
    name: str

    def __post_init__(self) -> None:  # before anything is applied under it
        if self.turn < 0:
            raise InvalidInput(f"effect {self.name!r}: turn {self.turn} is negative")
        if not re.fullmatch(EFFECT_NAME_PATTERN, self.name):
            raise InvalidInput(f"effect name {self.name!r} is not {EFFECT_NAME_PATTERN}")

    @property
    def id(self) -> str:
        """The key as one string, for the system the effect writes to: drop a second write."""
        return f"{self.rollout_id}/t{self.turn}/{self.name}"


def args_sha256(args: Any) -> str:
    """The digest an effect's arguments are compared by (canonical JSON; not JSON: refused)."""
    try:
        return canonical_sha256(args)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"an effect's args must be JSON: {exc}") from None


@dataclass
class _Rollout:
    current: int | None = None  # the attempt last run or restored here
    applied: dict[tuple[int, str], AppliedEffect] = field(default_factory=dict)


class EffectLedger:
    """The effects applied on one instance, by rollout, and each rollout's current attempt."""

    def __init__(self, max_rollouts: int = MAX_ROLLOUTS) -> None:
        self.max_rollouts = max_rollouts
        self._rollouts: OrderedDict[str, _Rollout] = OrderedDict()
        self._locks: dict[EffectKey, tuple[asyncio.Lock, int]] = {}  # the lock, its users

    def _touch(self, rollout_id: str) -> _Rollout:
        entry = self._rollouts.get(rollout_id)
        if entry is None:
            entry = self._rollouts[rollout_id] = _Rollout()
            while len(self._rollouts) > self.max_rollouts:
                self._rollouts.popitem(last=False)
        self._rollouts.move_to_end(rollout_id)
        return entry

    def make_current(self, episode: EpisodeRef) -> None:
        """``episode`` runs (or is restored) here: every other attempt of its rollout is
        superseded from now on."""
        self._touch(episode.rollout_id).current = episode.attempt

    def fence(self, episode: EpisodeRef) -> None:
        """Refuse a superseded attempt: another attempt of its rollout was run or restored
        here since it started."""
        entry = self._rollouts.get(episode.rollout_id)
        if entry is not None and entry.current not in (None, episode.attempt):
            raise ParticipantRefused(
                "superseded",
                f"{episode.key}: attempt {entry.current} of {episode.rollout_id} was run or "
                "restored on this instance since; this attempt makes no further effects",
            )

    @asynccontextmanager
    async def held(self, key: EffectKey) -> AsyncIterator[None]:
        """Held while a key is looked up and applied: a second attempt waits for the first.
        The lock lives while someone holds or awaits it."""
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def lookup(self, key: EffectKey, args_digest: str) -> AppliedEffect | None:
        """The effect applied under ``key`` (its arguments must match), or None."""
        entry = self._rollouts.get(key.rollout_id)
        done = None if entry is None else entry.applied.get((key.turn, key.name))
        if done is not None and done.args_sha256 != args_digest:
            raise EffectDiverged(
                key.id,
                f"applied by attempt {done.attempt} with args sha256 {done.args_sha256[:12]}, "
                f"asked again with {args_digest[:12]}: not applied twice",
            )
        return done

    def record(
        self, key: EffectKey, args_digest: str, result: Any, attempt: int, applied_ts: float
    ) -> None:
        """Record an effect ``attempt`` applied (its apply began at ``applied_ts``). A result
        that is not JSON is recorded all the same, as None, then refused (TypeError): applied
        is applied, whatever it returned."""
        try:
            canonical_sha256(result)
            kept = result
        except (TypeError, ValueError):
            kept = None
        applied = AppliedEffect(
            turn=key.turn,
            name=key.name,
            args_sha256=args_digest,
            result=kept,
            attempt=attempt,
            applied_ts=applied_ts,
        )
        self._touch(key.rollout_id).applied[(key.turn, key.name)] = applied
        if kept is not result:
            raise TypeError(
                f"effect {key.id}: apply returned a {type(result).__name__}, not JSON; "
                "recorded as applied with result None"
            )

    def of_rollout(self, rollout_id: str) -> tuple[AppliedEffect, ...]:
        entry = self._rollouts.get(rollout_id)
        return () if entry is None else tuple(entry.applied.values())

    def current(self, rollout_id: str) -> int | None:
        entry = self._rollouts.get(rollout_id)
        return None if entry is None else entry.current

    def install(self, rollout_id: str, effects: Iterable[AppliedEffect]) -> None:
        """Effects a restore's record carries; those this instance already holds stay."""
        entry = self._touch(rollout_id)
        for done in effects:
            entry.applied.setdefault((done.turn, done.name), done)
