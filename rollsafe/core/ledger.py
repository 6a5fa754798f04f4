"""The recovery ledger: every rollout's physical attempts, and how each restarts after a restore.

One row per live group (handed out, not yet trained or evicted) holding, per sibling: the
current attempt number, its state, the environment instance that owns it (turn/prefix levels),
and its *seal digest*: the sha256 of the sealed row's digest together with every field of its
ledger entry (run, group, sibling, attempt, restore level, owner: :func:`seal_digest`), so a
restore that finds any of them changed refuses the row by name, as it does a changed row. The
group's restore level is stored with it, so a later config change never reinterprets an old
group. (Format version 1, an earlier rollsafe's, stored the row's digest alone: still read.)

Rules (docs/design.md section 2; tables in :mod:`rollsafe.core.states`):

- ``dispatch`` RESERVED -> DISPATCHED; ``refuse`` goes back to RESERVED with the same attempt.
- ``seal`` DISPATCHED -> SEALED; sealing again with the same attempt and digest is a no-op,
  anything else is :class:`SealConflict`.
- ``fail`` / ``abandon`` end an attempt; ``abandon`` queues the episode for retirement on its
  environment. ``retry`` mints attempt + 1 of the same rollout id.
- ``restart`` (after a restore) applies the group's level: ``prompt_group`` abandons every
  sibling when any is unfinished; ``sibling`` keeps sealed siblings and retries the rest;
  ``turn`` / ``prefix`` keep an attempt whose episode its environment restored, as attempt + 1
  on the same instance, and fall back to ``sibling`` for the others.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from rollsafe.core.columns import Column, ColumnTable, check_metadata, format_metadata
from rollsafe.core.ids import EpisodeId, GroupId, RolloutId
from rollsafe.core.states import AttemptState, RestoreLevel, check_attempt
from rollsafe.errors import (
    InvalidInput,
    LedgerInvariantViolation,
    SealConflict,
    SnapshotCorrupt,
    UnknownGroup,
)
from rollsafe.snapshot.bounded import parse_json

__all__ = ["AttemptState", "Ledger", "RestartOutcome", "RestoreLevel", "Retirement"]

FORMAT = "rollsafe.ledger"
FORMAT_VERSION = "2"  # seal digests; "1" (row digests alone) is still read
DIGEST_BYTES = 32
NO_OWNER = -1
_SEALED = int(AttemptState.SEALED)
_DISPATCHED = int(AttemptState.DISPATCHED)
_RESERVED = int(AttemptState.RESERVED)


@dataclass(frozen=True, slots=True)
class Retirement:
    """An abandoned attempt its environment must refuse from now on."""

    episode: EpisodeId
    owner: str | None


@dataclass(frozen=True, slots=True)
class RestartOutcome:
    """What a group's restart kept and what it owes again."""

    kept: tuple[int, ...]  # sealed siblings whose rows stay
    resumed: tuple[int, ...]  # attempts its environment restored (turn/prefix), attempt + 1
    regenerate: tuple[int, ...]  # siblings generated again as a new attempt (or still reserved)
    dropped_rows: tuple[int, ...]  # sealed siblings discarded (prompt_group): delete their rows


class Ledger:
    def __init__(self, run_id: str, group_size: int) -> None:
        if group_size < 1:
            raise InvalidInput(f"group_size must be >= 1, got {group_size}")
        self.run_id = run_id
        self.group_size = group_size
        self._table = ColumnTable(self._spec(group_size))
        self._owners: list[str] = []
        self._owner_ids: dict[str, int] = {}
        self._retire: dict[str, Retirement] = {}
        self._row_digests_only = False  # restored from format version 1

    @staticmethod
    def _spec(group_size: int) -> dict[str, Column]:
        g = (group_size,)
        return {
            "level": Column(np.dtype(np.uint8)),
            "attempt": Column(np.dtype(np.int32), g),
            "state": Column(np.dtype(np.uint8), g, _RESERVED),
            "owner": Column(np.dtype(np.int32), g, NO_OWNER),
            "digest": Column(np.dtype(np.uint8), (*g, DIGEST_BYTES)),
        }

    # ---- identity and lookups -------------------------------------------------------------

    def rollout_id(self, idx: int, i: int) -> RolloutId:
        return GroupId(self.run_id, idx).rollout(i)

    def __contains__(self, idx: int) -> bool:
        return idx in self._table

    def __len__(self) -> int:
        return len(self._table)

    def groups(self) -> list[int]:
        return sorted(self._table)

    def _slot(self, idx: int) -> int:
        try:
            return self._table.slot(idx)
        except KeyError:
            raise UnknownGroup(f"group {idx} is not owned by run {self.run_id}") from None

    def _sibling(self, idx: int, i: int) -> int:
        slot = self._slot(idx)
        if not 0 <= i < self.group_size:
            raise InvalidInput(f"group {idx}: sibling {i} outside 0..{self.group_size - 1}")
        return slot

    def level(self, idx: int) -> RestoreLevel:
        return RestoreLevel(int(self._table.live("level")[self._slot(idx)]))

    def state(self, idx: int, i: int) -> AttemptState:
        return AttemptState(int(self._table.live("state")[self._sibling(idx, i), i]))

    def attempt(self, idx: int, i: int) -> int:
        return int(self._table.live("attempt")[self._sibling(idx, i), i])

    def episode(self, idx: int, i: int) -> EpisodeId:
        return self.rollout_id(idx, i).episode(self.attempt(idx, i))

    def owner(self, idx: int, i: int) -> str | None:
        owner = int(self._table.live("owner")[self._sibling(idx, i), i])
        return None if owner == NO_OWNER else self._owners[owner]

    def digest(self, idx: int, i: int) -> bytes | None:
        """The seal digest of a sealed sibling (:func:`seal_digest`); None if not sealed."""
        slot = self._sibling(idx, i)
        if self._table.live("state")[slot, i] != _SEALED:
            return None
        return bytes(self._table.live("digest")[slot, i])

    def seals(self, idx: int, i: int, attempt: int, row_digest: bytes) -> bytes:
        """The seal digest of sibling ``i``'s row with ``row_digest`` sealed by ``attempt``:
        what :meth:`digest` holds once it is sealed."""
        if self._row_digests_only:
            return row_digest
        owner = self.owner(idx, i)
        return seal_digest(self.run_id, idx, i, attempt, self.level(idx), owner, row_digest)

    def sealed_row_matches(self, idx: int, i: int, row_digest: bytes) -> bool:
        """Whether a sealed sibling's entry and a row with ``row_digest`` are what was sealed."""
        return self.seals(idx, i, self.attempt(idx, i), row_digest) == self.digest(idx, i)

    def states(self, idx: int) -> list[AttemptState]:
        return [AttemptState(int(s)) for s in self._table.live("state")[self._slot(idx)]]

    def sealed(self, idx: int) -> list[int]:
        return [i for i, s in enumerate(self.states(idx)) if s == AttemptState.SEALED]

    def unsealed(self, idx: int) -> list[int]:
        return [i for i, s in enumerate(self.states(idx)) if s != AttemptState.SEALED]

    def sealed_counts(self) -> dict[int, int]:
        counts = (self._table.live("state") == _SEALED).sum(axis=1)
        return dict(zip(self._table.keys_array().tolist(), counts.tolist(), strict=True))

    def retirements(self) -> list[Retirement]:
        return list(self._retire.values())

    def mark_retired(self, episodes: Iterable[EpisodeId]) -> None:
        """Environments now refuse these episodes; drops them from the queue."""
        for episode in episodes:
            self._retire.pop(episode.key, None)

    # ---- transitions ----------------------------------------------------------------------

    def reserve_group(self, idx: int, level: RestoreLevel) -> None:
        if idx in self._table:
            raise LedgerInvariantViolation(f"group {idx} is already owned by run {self.run_id}")
        slot = self._table.add(idx)
        self._table.column("level")[slot] = int(level)

    def drop_group(self, idx: int) -> None:
        """The group left the run (trained or evicted): retire whatever is still out there."""
        slot = self._slot(idx)
        for i, state in enumerate(self._table.live("state")[slot].tolist()):
            if state == _DISPATCHED:
                self._queue_retirement(slot, idx, i)
        self._table.remove(idx)

    def _move(self, idx: int, i: int, target: AttemptState, operation: str) -> int:
        slot = self._sibling(idx, i)
        states = self._table.column("state")
        current = int(states[slot, i])
        subject = f"rollout {self.episode(idx, i)}"
        check_attempt(subject, operation, current, target)
        states[slot, i] = int(target)
        return slot

    def dispatch(self, idx: int, i: int, owner: str | None = None) -> EpisodeId:
        """Mark the attempt DISPATCHED (in the same step that passes the admission gate)."""
        slot = self._sibling(idx, i)
        current_owner = self.owner(idx, i)
        if current_owner is not None and owner != current_owner:
            raise LedgerInvariantViolation(
                f"rollout {self.episode(idx, i)} was restored on {current_owner!r}; "
                f"it must be dispatched there, not to {owner!r}"
            )
        self._move(idx, i, AttemptState.DISPATCHED, "dispatch")
        self._table.column("owner")[slot, i] = self._owner_id(owner)
        return self.episode(idx, i)

    def refuse(self, idx: int, i: int) -> None:
        self._move(idx, i, AttemptState.RESERVED, "refuse")

    def check_seal(self, idx: int, i: int, attempt: int, digest: bytes) -> bool:
        """Would this seal apply? False when this exact seal was already applied; raises
        when it cannot (wrong attempt, different content, attempt not dispatched)."""
        if len(digest) != DIGEST_BYTES:
            raise InvalidInput(f"seal digest must be {DIGEST_BYTES} bytes, got {len(digest)}")
        current_attempt = self.attempt(idx, i)
        state = self.state(idx, i)
        if state == AttemptState.SEALED:
            if attempt == current_attempt and self.sealed_row_matches(idx, i, digest):
                return False
            raise SealConflict(
                f"rollout {self.episode(idx, i)} is already sealed with different content "
                f"(second seal: attempt {attempt}, digest {digest.hex()[:12]})"
            )
        if attempt != current_attempt:
            raise SealConflict(
                f"rollout {self.rollout_id(idx, i)}: seal from attempt {attempt} but the "
                f"current attempt is {current_attempt}"
            )
        check_attempt(f"rollout {self.episode(idx, i)}", "seal", state, AttemptState.SEALED)
        return True

    def seal(self, idx: int, i: int, attempt: int, digest: bytes) -> bool:
        """Seal with the row's digest. Returns False when this exact seal was already applied."""
        if not self.check_seal(idx, i, attempt, digest):
            return False
        sealed = self.seals(idx, i, attempt, digest)
        slot = self._move(idx, i, AttemptState.SEALED, "seal")
        self._table.column("digest")[slot, i] = np.frombuffer(sealed, dtype=np.uint8)
        return True

    def fail(self, idx: int, i: int) -> None:
        self._move(idx, i, AttemptState.FAILED, "fail")

    def abandon(self, idx: int, i: int) -> None:
        was_dispatched = self.state(idx, i) in (AttemptState.DISPATCHED, AttemptState.SEALED)
        slot = self._move(idx, i, AttemptState.ABANDONED, "abandon")
        if was_dispatched:
            self._queue_retirement(slot, idx, i)

    def retry(self, idx: int, i: int, keep_owner: bool = False) -> EpisodeId:
        """A new attempt of the same rollout (from FAILED or ABANDONED)."""
        slot = self._move(idx, i, AttemptState.RESERVED, "retry")
        self._table.column("attempt")[slot, i] += 1
        self._table.column("digest")[slot, i] = 0
        if not keep_owner:
            self._table.column("owner")[slot, i] = NO_OWNER
        return self.episode(idx, i)

    def _queue_retirement(self, slot: int, idx: int, i: int) -> None:
        episode = self.episode(idx, i)
        self._retire[episode.key] = Retirement(episode, self.owner(idx, i))

    def _owner_id(self, owner: str | None) -> int:
        if owner is None:
            return NO_OWNER
        if owner not in self._owner_ids:
            self._owner_ids[owner] = len(self._owners)
            self._owners.append(owner)
        return self._owner_ids[owner]

    # ---- restart after a restore ----------------------------------------------------------

    def restart(
        self,
        idx: int,
        restored: Mapping[int, str] | None = None,
        refused: Collection[int] = (),
        moved: Collection[int] = (),
    ) -> RestartOutcome:
        """Apply the group's restore level. ``restored`` maps sibling -> the instance that
        restored its current attempt's episode (turn/prefix levels only); ``refused``: siblings
        whose environment restore failed after retiring attempt n + 1 everywhere, so they
        restart from scratch as attempt n + 2; ``moved``: restored siblings whose instance is
        lost for good, restored on another that owns them from now on."""
        restored = dict(restored or {})
        level = self.level(idx)
        states = self.states(idx)
        if all(s == AttemptState.SEALED for s in states):
            return RestartOutcome(tuple(range(self.group_size)), (), (), ())
        if restored and level < RestoreLevel.TURN:
            raise LedgerInvariantViolation(
                f"group {idx} restores at level {level.label}; environments cannot restore "
                f"its episodes {sorted(restored)}"
            )
        kept: list[int] = []
        resumed: list[int] = []
        regenerate: list[int] = []
        dropped: list[int] = []
        prompt_group = level == RestoreLevel.PROMPT_GROUP
        for i, state in enumerate(states):
            if state == AttemptState.SEALED and not prompt_group:
                kept.append(i)
            elif state == AttemptState.DISPATCHED and i in restored:
                self._resume_on(idx, i, restored.pop(i), moved=i in moved)
                resumed.append(i)
            else:
                if state == AttemptState.SEALED:
                    dropped.append(i)
                self._restart_sibling(idx, i, state)
                if i in refused and state == AttemptState.DISPATCHED:
                    self._skip_refused(idx, i)
                regenerate.append(i)
        if restored:
            raise LedgerInvariantViolation(
                f"group {idx}: environments restored siblings {sorted(restored)} that have no "
                f"dispatched attempt"
            )
        return RestartOutcome(tuple(kept), tuple(resumed), tuple(regenerate), tuple(dropped))

    def _resume_on(self, idx: int, i: int, instance: str, *, moved: bool = False) -> None:
        owner = self.owner(idx, i)
        if owner != instance and not moved:
            raise LedgerInvariantViolation(
                f"rollout {self.episode(idx, i)} is owned by {owner!r} but {instance!r} restored it"
            )
        # The old episode's state lives on as attempt + 1 on the instance that restored it.
        slot = self._move(idx, i, AttemptState.ABANDONED, "restore")
        self.retry(idx, i, keep_owner=True)
        self._table.column("owner")[slot, i] = self._owner_id(instance)

    def _skip_refused(self, idx: int, i: int) -> None:
        """The environments refuse this (reserved) attempt forever: retire it everywhere again
        (retiring is idempotent) and mint the next."""
        episode = self.episode(idx, i)
        self._move(idx, i, AttemptState.ABANDONED, "skip a refused attempt")
        self._retire[episode.key] = Retirement(episode, None)
        self.retry(idx, i)

    def _restart_sibling(self, idx: int, i: int, state: AttemptState) -> None:
        if state == AttemptState.RESERVED:
            return  # never left the controller: nothing to retire, no attempt spent
        if state in (AttemptState.DISPATCHED, AttemptState.SEALED):
            self.abandon(idx, i)
        self.retry(idx, i)

    # ---- capture and restore --------------------------------------------------------------

    def capture(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """Arrays (read-only views in row order: ``in_key_order`` sorts them, as
        :meth:`restore` takes them) and string metadata for a snapshot; no I/O, no copy."""
        arrays = self._table.capture()
        metadata = {
            **format_metadata(FORMAT, "1" if self._row_digests_only else FORMAT_VERSION),
            "run_id": self.run_id,
            "group_size": str(self.group_size),
            "owners": json.dumps(self._owners),
            "retire": json.dumps([[r.episode.key, r.owner] for r in self._retire.values()]),
        }
        return arrays, metadata

    @classmethod
    def restore(
        cls, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str], source: str
    ) -> Ledger:
        fields = {"run_id", "group_size", "owners", "retire"}
        version = check_metadata(metadata, FORMAT, fields, source, ("1", FORMAT_VERSION))
        try:
            ledger = cls(metadata["run_id"], int(metadata["group_size"]))
            owners = [str(o) for o in parse_json(metadata["owners"])]
            retire = [(str(k), o) for k, o in parse_json(metadata["retire"])]
            episodes = [(EpisodeId.parse(k), o) for k, o in retire]
        except (ValueError, TypeError, InvalidInput) as exc:
            raise SnapshotCorrupt(f"{source}: bad ledger metadata ({exc})") from None
        ledger._table = ColumnTable.from_capture(cls._spec(ledger.group_size), arrays, source)
        ledger._owners = owners
        ledger._owner_ids = {name: n for n, name in enumerate(owners)}
        ledger._retire = {e.key: Retirement(e, o) for e, o in episodes}
        ledger._row_digests_only = version == "1"
        ledger._validate(source)
        return ledger

    def _validate(self, source: str) -> None:
        states = self._table.live("state")
        if states.size and int(states.max()) > max(AttemptState):
            raise SnapshotCorrupt(f"{source}: unknown attempt state {int(states.max())}")
        levels = self._table.live("level")
        if levels.size and int(levels.max()) > max(RestoreLevel):
            raise SnapshotCorrupt(f"{source}: unknown restore level {int(levels.max())}")
        owners = self._table.live("owner")
        if owners.size and not (int(owners.min()) >= -1 and int(owners.max()) < len(self._owners)):
            raise SnapshotCorrupt(f"{source}: owner reference outside the owner table")
        if (self._table.live("attempt") < 0).any():
            raise SnapshotCorrupt(f"{source}: negative attempt number")


def seal_digest(
    run_id: str,
    idx: int,
    i: int,
    attempt: int,
    level: RestoreLevel,
    owner: str | None,
    row_digest: bytes,
) -> bytes:
    """What a sealed sibling's ledger entry stores: the sha256 of its row's digest and every
    field of the entry, so that neither can change unnoticed (a snapshot whose ledger says
    attempt 2 where attempt 1 sealed the row is refused, as a changed row is)."""
    entry = json.dumps([run_id, idx, i, attempt, int(level), owner], separators=(",", ":"))
    return hashlib.sha256(b"rollsafe.seal/2\x00" + entry.encode() + b"\x00" + row_digest).digest()
