"""The run state: loader position, ledger, replay index, sampler and data plane as one run.

A plain class with no I/O but the data plane's. The controller
(:class:`rollsafe.checkpoint.controller.Controller`) owns one and runs the checkpoint phases
around it; the scenario runner drives it directly.

:meth:`RunState.take_capture` takes everything needed to restore, while the run stands still;
rollsafe.snapshot.state_files writes it into a draft (after cross-checking that the ledger, the
index and the data plane agree) and loads the newest snapshot that verifies back
(:meth:`RunState.load`, :meth:`RunState.verify_rows`: every restored row checked against the
digest it was sealed with). :meth:`RunState.restart_from` then releases claims of steps that
never committed, applies each group's restart rule and returns a :class:`RestorePlan` saying
what is owed and how.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollsafe.core.buffer import ReplayIndex, make_sampler
from rollsafe.core.capture import CapturedState, LoaderState
from rollsafe.core.config import RunConfig
from rollsafe.core.ids import EpisodeId
from rollsafe.core.ledger import Ledger
from rollsafe.core.phases import PartialGroup, RestorePlan
from rollsafe.core.states import GroupState, RecordKind, RestoreLevel
from rollsafe.dataplane import DataPlane, Row, row_digest
from rollsafe.errors import (
    InvalidInput,
    LedgerInvariantViolation,
    RowMismatch,
    TopologyMismatch,
)

ROLLOUT_PARTITION = "rollouts"
# The manifest's count naming the last journal record a snapshot covers.
JOURNAL_POSITION = "journal_position"
_VERIFY_BATCH = 1024


@dataclass(frozen=True)
class Captured:
    """What a capture wrote, with the values its manifest must carry."""

    weight_version: int
    loader_position: int
    counts: dict[str, int]
    journal_id: str | None = None  # the journal whose records up to counts' position it covers


@dataclass(frozen=True)
class Capture:
    """What a capture took while the run stood still (:meth:`RunState.take_capture`), to be
    written into a draft while the run goes on (rollsafe.snapshot.state_files.write_capture)."""

    state: CapturedState
    counts: dict[str, int]
    journal_id: str | None = None


@dataclass(frozen=True)
class EnvironmentsRestored:
    """What a restore's environments did with the snapshot's episodes."""

    # Attempt n of each episode an instance restored (as attempt n + 1) -> that instance.
    episodes: Mapping[EpisodeId, str]
    # Attempt n of each episode the environments could not restore: its attempt n + 1 is
    # retired (refused forever), so the rollout restarts from scratch as attempt n + 2.
    refused: frozenset[EpisodeId] = frozenset()
    errors: Mapping[str, str] = field(default_factory=dict)  # instance -> why it failed
    # Episodes restored on another instance than the one that ran them (lost for good):
    # their rollouts are owned by the restoring instance from now on.
    moved: frozenset[EpisodeId] = frozenset()
    lost: Mapping[str, str] = field(default_factory=dict)  # lost instance -> what became of it


@dataclass(frozen=True)
class RestoredSnapshot:
    """What a restore plan names of the snapshot it restored."""

    snapshot: str  # its directory's name
    checkpoint_id: str
    skipped: Mapping[str, str]  # newer snapshots refused, with the reason


# Whether the journal changed an episode's rollout after the snapshot (Replay.changed).
Changed = Callable[[EpisodeId], bool]


def unchanged(_: EpisodeId) -> bool:
    """No journal: nothing changed after the snapshot."""
    return False


class JournalSink(Protocol):
    """Where a run state's changes are appended (:class:`rollsafe.journal.run.RunJournal`)."""

    def append(self, kind: RecordKind, meta: Mapping[str, Any], row: Row | None = None) -> int:
        """Append one record (not durable yet); its id."""
        ...

    @property
    def last_id(self) -> int:
        """The id of the last record appended."""
        ...

    @property
    def journal_id(self) -> str | None:
        """The journal's identity, named in each snapshot's manifest."""
        ...

    def wait_durable(self, record_id: int) -> None:
        """Return once record ``record_id`` (and every one before it) is durable."""
        ...


class Replay(Protocol):
    """What a journal replay tells the rest of the restore (rollsafe.journal.replay)."""

    rolled_back: list[int]  # ids of commit records not applied (newer than the weights)

    def changed(self, episode: EpisodeId) -> bool:
        """Whether the journal changed this episode's rollout after the snapshot (sealed,
        restarted, or its group left the run since): the environments do not restore it."""
        ...


class RunState:
    def __init__(self, config: RunConfig, dataplane: DataPlane) -> None:
        self.config = config
        self.dataplane = dataplane
        self.ledger = Ledger(config.run_id, config.group_size)
        self.index = ReplayIndex(config.group_size)
        self.sampler = make_sampler(config.sampler, config.staleness_window)
        self.level = RestoreLevel.parse(config.restore_level)
        self.loader_position = 0
        self.handed_out = 0  # groups, ever: the loader's count (LoaderState.handed_out)
        self.weight_version = 0
        # Each change below is appended here once it is made (None: no journal).
        self.journal: JournalSink | None = None
        # While a capture is taken and not written: rows whose deletion waits for it (a step's
        # commit or an eviction drops them from the ledger at once, from the data plane after).
        self._held_deletes: list[str] | None = None
        # Rows dropped whose deletion the caller makes, outside its lock (the controller: a
        # remote data plane's call under its barrier would hold up every operation of the run):
        # :meth:`take_due_deletes`, then :meth:`delete_rows`. False: deleted at once.
        self.defer_deletes = False
        self._due_deletes: list[str] = []

    def _log(self, kind: RecordKind, meta: Mapping[str, Any], row: Row | None = None) -> None:
        if self.journal is not None:
            self.journal.append(kind, meta, row)

    # ---- the run ---------------------------------------------------------------------------

    def handout(self, groups: Sequence[int]) -> None:
        """The loader hands out these dataset indices, reserved at the current weight version."""
        if not groups:
            raise InvalidInput("handout needs at least one dataset index")
        if len(set(groups)) != len(groups):
            raise InvalidInput(f"handout repeats an index: {list(groups)}")
        below = [idx for idx in groups if idx < self.loader_position]
        if below:
            raise InvalidInput(
                f"handout of {below}: below the loader position {self.loader_position}"
            )
        for idx in groups:
            self.index.reserve(idx, self.weight_version)
            self.ledger.reserve_group(idx, self.level)
        self.loader_position = max(groups) + 1
        self.handed_out += len(groups)
        self._log(RecordKind.HANDOUT, {"groups": [int(idx) for idx in groups]})

    def row_key(self, idx: int, i: int) -> str:
        return self.ledger.rollout_id(idx, i).key

    def dispatch(self, idx: int, i: int, owner: str | None = None) -> EpisodeId:
        episode = self.ledger.dispatch(idx, i, owner)
        self.index.start(idx, self.weight_version)
        meta = {"group": int(idx), "sibling": int(i), "attempt": episode.attempt, "owner": owner}
        self._log(RecordKind.DISPATCH, meta)
        return episode

    def seal(self, idx: int, i: int, attempt: int, row: Row) -> bool:
        """Commit a finished rollout's row. False when this exact seal was already applied.
        In three steps a caller may split (the controller puts the row outside its barrier):
        :meth:`check_seal`, the data plane's put, :meth:`mark_sealed`."""
        digest = row_digest(row)
        if not self.check_seal(idx, i, attempt, digest):
            return False
        self.dataplane.put(ROLLOUT_PARTITION, {self.row_key(idx, i): row})
        return self.mark_sealed(idx, i, attempt, row, digest)

    def check_seal(self, idx: int, i: int, attempt: int, digest: bytes) -> bool:
        """Would this seal apply? False when it already did; raises when it cannot."""
        return self.ledger.check_seal(idx, i, attempt, digest)

    def mark_sealed(self, idx: int, i: int, attempt: int, row: Row, digest: bytes) -> bool:
        """The rollout's row is in the data plane: seal it in the ledger and the index and
        journal it. False when this exact seal was already applied."""
        if not self.ledger.seal(idx, i, attempt, digest):
            return False
        self.index.set_sealed(idx, len(self.ledger.sealed(idx)))
        meta = {"group": int(idx), "sibling": int(i), "attempt": int(attempt)}
        self._log(RecordKind.SEAL, meta, row)
        return True

    def claim(self, groups: Sequence[int], step: int) -> None:
        self.index.claim(groups, step)
        self._log(RecordKind.CLAIM, {"groups": [int(idx) for idx in groups], "step": int(step)})

    def commit_step(self, groups: Sequence[int]) -> None:
        """An optimizer step trained ``groups`` and committed: they leave the run for good,
        and the policy moves to the next weight version."""
        if len(set(groups)) != len(groups):
            raise InvalidInput(f"a step cannot train a group twice: {list(groups)}")
        keys = {idx: self._sealed_keys(idx) for idx in groups}
        self.index.train(groups)
        for idx in groups:
            self._drop(idx, keys[idx])
        self.sampler.committed(self.index, groups)
        self.weight_version += 1
        self._log(RecordKind.COMMIT, {"groups": [int(idx) for idx in groups]})

    def evict(self, idx: int) -> None:
        keys = self._sealed_keys(idx)
        self.index.evict(idx)
        self._drop(idx, keys)
        self._log(RecordKind.EVICT, {"group": int(idx)})

    def claimed_rows(self, groups: Sequence[int]) -> dict[int, list[Row]]:
        """The sealed rows of ``groups``, each group's in sibling order: groups claimed by a
        step that has not committed yet (:meth:`commit_step` drops their rows)."""
        return self.rows_of(self.claimed_keys(groups))

    def rows_of(self, keys: Mapping[int, list[str]]) -> dict[int, list[Row]]:
        """The rows under ``keys`` (group -> its row keys), read from the data plane."""
        found = self.dataplane.get(ROLLOUT_PARTITION, [key for ks in keys.values() for key in ks])
        return {idx: [found[key] for key in ks] for idx, ks in keys.items()}

    def claimed_keys(self, groups: Sequence[int]) -> dict[int, list[str]]:
        """The row keys of :meth:`claimed_rows` (no I/O)."""
        unclaimed = [
            idx
            for idx in groups
            if idx not in self.index or self.index.state(idx) != GroupState.CLAIMED
        ]
        if unclaimed:
            raise InvalidInput(
                f"rows of groups {unclaimed}: not claimed; a step's rows are read between "
                "claim and commit_step"
            )
        return {idx: self._sealed_keys(idx) for idx in groups}

    def owed(self) -> list[tuple[int, int]]:
        """Every rollout handed out and not sealed, as (group, sibling): groups already
        generating first (they may be the only work that can advance the trainer), then those
        never dispatched, each in dataset order, as a restore plan's ``redispatch``."""
        groups = self._generating_first(self.ledger.groups())
        return [(idx, i) for idx in groups for i in self.ledger.unsealed(idx)]

    def _generating_first(self, groups: Iterable[int]) -> list[int]:
        return sorted(groups, key=lambda idx: (self.index.state(idx) != GroupState.GENERATING, idx))

    def set_weight_version(self, version: int) -> None:
        if version < self.weight_version:
            raise InvalidInput(
                f"weight version {version} is older than the current {self.weight_version}"
            )
        self.weight_version = version
        self._log(RecordKind.WEIGHT_VERSION, {"version": int(version)})

    def select(self) -> list[int]:
        return self.sampler.select(self.index, self.weight_version, self.config.groups_per_step)

    def stale(self) -> list[int]:
        """Ready groups the sampler will never pick: evicting them is the run's call."""
        return self.sampler.stale(self.index, self.weight_version)

    def _sealed_keys(self, idx: int) -> list[str]:
        return [self.row_key(idx, i) for i in self.ledger.sealed(idx)]

    def _drop(self, idx: int, keys: list[str]) -> None:
        self.ledger.drop_group(idx)
        if keys and self._held_deletes is not None:
            self._held_deletes.extend(keys)
        else:
            self.discard_rows(keys)

    def discard_rows(self, keys: list[str]) -> None:
        """Delete these rows now, or (``defer_deletes``) once the caller takes them."""
        if self.defer_deletes:
            self._due_deletes.extend(keys)
        else:
            self.delete_rows(keys)

    def take_due_deletes(self) -> list[str]:
        """The rows dropped since the last call, to :meth:`delete_rows` (``defer_deletes``)."""
        due, self._due_deletes = self._due_deletes, []
        return due

    def delete_rows(self, keys: list[str]) -> None:
        if keys:
            self.dataplane.delete(ROLLOUT_PARTITION, keys)

    # ---- checkpoint ------------------------------------------------------------------------

    def take_capture(self) -> Capture:
        """Take what a snapshot needs: views of the columns (copied on the run's next write)
        and their counts; no data plane call, so the caller's barrier (which keeps writers out
        meanwhile) does not grow with the run or wait on a remote store. From here until
        :meth:`release_capture`, rows the run drops stay in the data plane, so the capture's
        rows can be written later (rollsafe.snapshot.state_files.write_capture, which checks
        that they all agree)."""
        if self._held_deletes is not None:
            raise InvalidInput("a capture is taken and not written yet: one at a time")
        state = self.capture()
        counts = {**state.counts(), "sealed_rollouts": state.sealed()}
        journal_id = None
        if self.journal is not None:  # the records this snapshot covers (docs/journal.md)
            counts[JOURNAL_POSITION] = self.journal.last_id
            journal_id = self.journal.journal_id
        self._held_deletes = []
        return Capture(state=state, counts=counts, journal_id=journal_id)

    def release_capture(self) -> None:
        """The capture is written, or never will be: the deletions it held back happen now."""
        held, self._held_deletes = self._held_deletes, None
        self.discard_rows(held or [])

    def journaled(self, captured: Captured) -> None:
        """Return once the journal holds every record ``captured`` covers: a snapshot never
        names a journal position the journal may not hold (call before publishing it)."""
        position = captured.counts.get(JOURNAL_POSITION)
        if position is not None and self.journal is not None:
            self.journal.wait_durable(position)

    def capture(self) -> CapturedState:
        """Everything but the data plane's rows, as views in row order (the columns copy on
        their next write: rollsafe.core.columns); no I/O."""
        return CapturedState(
            ledger=self.ledger.capture(),
            index=self.index.capture(),
            loader=LoaderState(
                position=self.loader_position,
                weight_version=self.weight_version,
                handed_out=self.handed_out,
            ),
            sampler=self.sampler.state(),
            config=self.config,
        )

    # ---- restore ---------------------------------------------------------------------------

    def restart_from(
        self, source: RestoredSnapshot, envs: EnvironmentsRestored, replayed: Replay | None
    ) -> RestorePlan:
        """A restore's last step, after :meth:`load` and the journal's replay: :meth:`restart`,
        journaled when the journal was replayed (replaying this restore later must decide the
        same), and the plan."""
        released, partial = self.restart(envs)
        if replayed is not None:
            self._log(RecordKind.RESTART, _restart_meta(envs, replayed.rolled_back))
        return self._plan(source, envs, released, partial)

    def load(self, state: CapturedState, snapshot: str, sources: tuple[str, str]) -> None:
        """Take a snapshot's state (read from its files: rollsafe.snapshot.state_files); its
        rows are the data plane's, imported by the caller. ``snapshot`` and ``sources`` (where
        the ledger and the index were read from) name them in errors."""
        for name in ("run_id", "group_size", "sampler"):
            saved, configured = getattr(state.config, name), getattr(self.config, name)
            if saved != configured:
                raise TopologyMismatch(
                    f"snapshot {snapshot} was taken with {name}={saved!r}; "
                    f"this run has {configured!r}"
                )
        self.ledger = Ledger.restore(*state.ledger, sources[0])
        self.index = ReplayIndex.restore(*state.index, sources[1])
        self.loader_position = state.loader.position
        self.weight_version = state.loader.weight_version
        index = self.index
        self.handed_out = state.loader.handed_out or (
            len(index) + index.trained_total + index.evicted_total  # format 1: as it agreed
        )
        self.sampler.load_state(state.sampler, self.index)

    def verify_rows(self, snapshot: str) -> None:
        """Every sealed rollout's row must come back byte for byte (its sealed digest)."""
        pending: list[tuple[int, int, str]] = []
        for idx in self.ledger.groups():
            pending.extend((idx, i, self.row_key(idx, i)) for i in self.ledger.sealed(idx))
        for start in range(0, len(pending), _VERIFY_BATCH):
            batch = pending[start : start + _VERIFY_BATCH]
            rows = self.dataplane.get(ROLLOUT_PARTITION, [key for _, _, key in batch])
            for idx, i, key in batch:
                if not self.ledger.sealed_row_matches(idx, i, row_digest(rows[key])):
                    raise RowMismatch(
                        idx, i, key, f"snapshot {snapshot}: row or ledger entry is not what sealed"
                    )

    def _check_owned(self, episode: EpisodeId, what: str) -> None:
        """An episode the environments name must be the ledger's current attempt."""
        idx, i = episode.rollout.group.idx, episode.rollout.i
        if idx not in self.ledger or self.ledger.episode(idx, i) != episode:
            raise LedgerInvariantViolation(f"{what} episode {episode} is not owned by the run")

    def restartable(self) -> list[int]:
        """Groups a restart applies its rule to: handed out or generating."""
        return self.index.in_states(GroupState.RESERVED, GroupState.GENERATING)

    def restart(self, envs: EnvironmentsRestored) -> tuple[list[int], dict[int, PartialGroup]]:
        """After a restore: release the claims of steps that never committed and apply each
        restartable group's restore level, given what the environments restored. Returns the
        released groups and what became of each restarted group."""
        released = self.index.release_claims()
        refused: dict[int, set[int]] = {}
        for episode in envs.refused:
            self._check_owned(episode, "refused")
            refused.setdefault(episode.rollout.group.idx, set()).add(episode.rollout.i)
        by_group: dict[int, dict[int, str]] = {}
        moved: dict[int, set[int]] = {}
        for episode, instance in envs.episodes.items():
            self._check_owned(episode, "restored")
            by_group.setdefault(episode.rollout.group.idx, {})[episode.rollout.i] = instance
            if episode in envs.moved:
                moved.setdefault(episode.rollout.group.idx, set()).add(episode.rollout.i)
        partial: dict[int, PartialGroup] = {}
        for idx in self.restartable():
            outcome = self.ledger.restart(
                idx, by_group.pop(idx, None), refused.get(idx, ()), moved.get(idx, ())
            )
            if outcome.dropped_rows:
                self.dataplane.delete(
                    ROLLOUT_PARTITION, [self.row_key(idx, i) for i in outcome.dropped_rows]
                )
            self.index.set_sealed(idx, len(outcome.kept))
            partial[idx] = PartialGroup(
                restored=list(outcome.kept),
                resumed=list(outcome.resumed),
                regenerate=list(outcome.regenerate),
            )
        if by_group:
            raise LedgerInvariantViolation(
                "environments restored episodes of groups that are not generating: "
                f"{sorted(by_group)}"
            )
        return released, partial

    def _plan(
        self,
        source: RestoredSnapshot,
        envs: EnvironmentsRestored,
        released: list[int],
        partial: dict[int, PartialGroup],
    ) -> RestorePlan:
        admitted_first = self._generating_first(partial)
        return RestorePlan(
            snapshot=source.snapshot,
            checkpoint_id=source.checkpoint_id,
            skipped=dict(source.skipped),
            loader_position=self.loader_position,
            weight_version=self.weight_version,
            ready=self.index.in_states(GroupState.READY),
            partial=partial,
            released_claims=released,
            redispatch=admitted_first,
            environments_failed=dict(envs.errors),
            environments_lost=dict(envs.lost),
        )


def _restart_meta(envs: EnvironmentsRestored, rolled_back: Sequence[int]) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "why": "restore",
        "rolled_back": list(rolled_back),
        "episodes": {episode.key: name for episode, name in envs.episodes.items()},
        "refused": sorted(episode.key for episode in envs.refused),
    }
    if envs.moved:  # only then: a journal without a lost instance reads as it always did
        meta["moved"] = sorted(episode.key for episode in envs.moved)
    return meta
