"""Replay: a restored snapshot's run state brought forward by the journal records after it.

Pure: records in, :class:`~rollsafe.core.run_state.RunState` operations out, no I/O. Each
record is applied once: those the snapshot covers (ids up to its journal position) are
skipped, the rest applied in id order through the same operations that wrote them, so the
state after replay is the state the run had when its last durable record was written.

Step commits newer than the weights the trainer restored are *rolled back*: not applied, so
their groups stay claimed and the restart after replay gives them back as ready, rows and
all (the rows came from the snapshot or from the journal's seals). The restart a restore
applied is itself a record (RESTART), replayed with the environments' answers it recorded,
so a run restored twice replays to the same state both times.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollsafe.core.ids import EpisodeId
from rollsafe.core.phases import JournalReplayed, StopReport
from rollsafe.core.run_state import EnvironmentsRestored, RunState
from rollsafe.errors import JournalCorrupt, NoValidSnapshot, RollsafeError
from rollsafe.journal.format import Record, RecordKind, Stop
from rollsafe.journal.segments import JournalRead, JournalStop, current_stop, journal_gap

Index = Annotated[int, Field(ge=0)]


class _Meta(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HandoutMeta(_Meta):
    groups: list[Index] = Field(min_length=1)


class RolloutMeta(_Meta):
    """A dispatch or a seal: which rollout, which attempt (checked against the ledger)."""

    group: Index
    sibling: Index
    attempt: Index
    owner: str | None = None  # dispatch only: the environment instance


class ClaimMeta(_Meta):
    groups: list[Index] = Field(min_length=1)
    step: Index


class CommitMeta(_Meta):
    groups: list[Index]


class EvictMeta(_Meta):
    group: Index


class WeightVersionMeta(_Meta):
    version: Index


class RestartMeta(_Meta):
    """What a restore decided, so replaying it decides the same: which journal records it
    rolled back, and what the environments answered (episode key -> instance; refused)."""

    why: Literal["restore", "start_over"]
    rolled_back: list[int] = Field(default_factory=list)
    episodes: dict[str, str] = Field(default_factory=dict)
    refused: list[str] = Field(default_factory=list)
    moved: list[str] = Field(default_factory=list)  # restored off a lost instance
    # What the restore was told to go on without (accept_journal_loss), each naming what.
    accepted_loss: list[str] = Field(default_factory=list)

    def environments(self) -> EnvironmentsRestored:
        return EnvironmentsRestored(
            {EpisodeId.parse(key): name for key, name in self.episodes.items()},
            refused=frozenset(EpisodeId.parse(key) for key in self.refused),
            moved=frozenset(EpisodeId.parse(key) for key in self.moved),
        )


META: dict[RecordKind, type[_Meta]] = {
    RecordKind.HANDOUT: HandoutMeta,
    RecordKind.DISPATCH: RolloutMeta,
    RecordKind.SEAL: RolloutMeta,
    RecordKind.CLAIM: ClaimMeta,
    RecordKind.COMMIT: CommitMeta,
    RecordKind.EVICT: EvictMeta,
    RecordKind.WEIGHT_VERSION: WeightVersionMeta,
    RecordKind.RESTART: RestartMeta,
}


@dataclass
class Replayed:
    """What a replay did, for the restore plan and the logs."""

    covered: int  # the snapshot's journal position: records up to it were skipped
    applied: int = 0
    last_id: int = 0  # the last record applied or covered
    rolled_back: list[int] = field(default_factory=list)  # ids of commits not applied
    rolled_back_groups: list[int] = field(default_factory=list)
    touched: set[tuple[int, int]] = field(default_factory=set)  # (group, sibling) changed
    stops: list[JournalStop] = field(default_factory=list)  # every stop reading found
    accepted_loss: list[str] = field(default_factory=list)  # problems gone on without
    set_aside: list[Path] = field(default_factory=list)  # files never applied: moved aside

    @property
    def stop(self) -> Stop | None:
        """The stop that ended this replay (none of the journal's restores went on after it)."""
        current = current_stop(self.stops)
        return current.stop if current is not None else None

    def summary(self) -> JournalReplayed:
        stops = [
            StopReport(
                segment=stop.segment.name,
                offset=stop.stop.offset,
                record=stop.stop.record,
                reason=stop.stop.reason,
                detail=stop.stop.detail,
                superseded=stop.superseded,
            )
            for stop in self.stops
        ]
        current = current_stop(self.stops)
        return JournalReplayed(
            covered=self.covered,
            records=self.applied,
            last_id=self.last_id,
            rolled_back_groups=sorted(self.rolled_back_groups),
            stop=current.describe() if current is not None else None,
            stops=stops,
            accepted_loss=list(self.accepted_loss),
        )

    def changed(self, episode: EpisodeId) -> bool:
        """Whether the journal changed this episode's rollout after the snapshot (sealed,
        dispatched again, restarted, or its group trained or evicted)."""
        return (episode.rollout.group.idx, episode.rollout.i) in self.touched


@dataclass(frozen=True)
class Covered:
    """What a snapshot says of the journal: the last record it covers (None: taken with the
    journal off) and the journal's id (None: an earlier rollsafe's manifest, which has none)."""

    snapshot: str
    position: int | None
    journal_id: str | None


def replay(
    state: RunState,
    read: JournalRead,
    covered: Covered,
    weight_version: int | None = None,
    *,
    accept_loss: bool = False,
) -> Replayed:
    """Apply the records of ``read`` after the snapshot's position to ``state``.
    ``weight_version``: the weights the trainer restored; commits past them are rolled back
    (None: every commit stands). :class:`JournalGap` when the journal does not continue the
    snapshot (a gap, a segment or the folder missing, another journal: named) unless
    ``accept_loss``, and then the records that continue it are applied, the rest are set
    aside and the plan says what was given up; :class:`JournalCorrupt` when a record does not
    fit the state it is applied to."""
    position = covered.position or 0
    first = next((record for record in read.records if record.id > position), None)
    problems = [*read.problems, *_discontinuity(read, covered, first)]
    if problems and not accept_loss:
        raise journal_gap(problems)
    usable = _usable(read, covered, problems, first)
    after = [record for record in usable if record.id > position]
    replayed = Replayed(
        covered=position,
        last_id=max(position, usable[-1].id if usable else 0),
        stops=list(read.stops),
        accepted_loss=problems,
        set_aside=[*read.unusable, *_not_applied(read, usable)] if problems else [],
    )
    applying = _Replay(state, replayed, weight_version, _rolled_back_before(after))
    state.journal, sink = None, state.journal  # replaying writes nothing
    try:
        for record in after:
            applying.apply(record)
    finally:
        state.journal = sink
    if weight_version is not None and state.weight_version != weight_version:
        raise NoValidSnapshot(
            covered.snapshot,
            {
                covered.snapshot: f"with the journal after it, the run reaches weight version "
                f"{state.weight_version}, not the {weight_version} the trainer restored",
            },
        )
    return replayed


def _restarts(record: Record) -> bool:
    """A segment a restore opened starts with its RESTART (its first id may skip ids the
    snapshot covered and the journal lost, or a torn tail)."""
    return record.kind == RecordKind.RESTART


def _gap_before(first: Record | None, position: int) -> bool:
    """Whether ``first``, the journal's first record after a snapshot's ``position``, leaves
    records between them missing (a segment a restore opened may skip ids: its RESTART)."""
    return first is not None and first.id != position + 1 and not _restarts(first)


def _discontinuity(read: JournalRead, covered: Covered, first: Record | None) -> list[str]:
    """Why the journal in ``read`` does not continue the snapshot, if it does not; ``first``:
    its first record after the snapshot's position."""
    snapshot, position = covered.snapshot, covered.position
    theirs, ours = read.journal_id, covered.journal_id
    if ours is not None and theirs != ours:
        held = f"journal {theirs}" if theirs else "an earlier rollsafe's journal"
        where = held if read.segments else "no journal (its folder is missing or empty)"
        return [f"snapshot {snapshot} covers journal {ours} up to record {position}; {where} "
                "is here"]  # fmt: skip
    if position is None:
        if not read.records:
            return []
        return [
            f"snapshot {snapshot} names no journal position (taken with the journal off) "
            f"and the journal holds records {read.records[0].id}..{read.records[-1].id}: it "
            "cannot be replayed onto it (restore with the journal off for the snapshot alone)"
        ]
    if first is not None and _gap_before(first, position):
        return [
            f"snapshot {snapshot} covers the journal up to record {position} but the journal "
            f"goes on at record {first.id}: records {position + 1}..{first.id - 1} are missing"
        ]
    reached = max([read.end or 0, *(segment.first_id - 1 for segment in read.segments)])
    if first is None and reached < position and (read.segments or ours is not None):
        return [
            f"snapshot {snapshot} covers the journal up to record {position} but the journal "
            f"ends at record {reached}: its newest segments are missing"
        ]
    return []


def _usable(
    read: JournalRead, covered: Covered, problems: list[str], first: Record | None
) -> list[Record]:
    """The records a restore that accepted ``problems`` applies: those that continue the
    snapshot (none of another journal, none after a gap)."""
    if not problems:
        return read.records
    if covered.position is None or (covered.journal_id or read.journal_id) != read.journal_id:
        return []
    if _gap_before(first, covered.position):
        return [record for record in read.records if record.id <= covered.position]
    return read.records


def _not_applied(read: JournalRead, usable: list[Record]) -> list[Path]:
    """The segments after the records a restore that accepted a loss applies (``usable`` is
    a prefix of ``read.records``): set aside with the unusable ones, so that the journal left
    in place is exactly what the restored run holds."""
    if not usable:
        return [segment.path for segment in read.segments]
    kept = usable[-1].id
    return [segment.path for segment in read.segments if segment.first_id > kept]


def _meta(record: Record) -> Any:
    """The record's metadata, checked against its kind's model."""
    try:
        return META[record.kind].model_validate(dict(record.meta))
    except ValidationError as exc:
        problem = exc.errors()[0]
        raise JournalCorrupt(f"{_where(record)}: {problem['msg']} at {problem['loc']}") from None


def _where(record: Record) -> str:
    return f"journal record {record.id} ({record.kind.name.lower()})"


def _rolled_back_before(records: Iterable[Record]) -> set[int]:
    """Commits an earlier restore rolled back (its RESTART record names them)."""
    ids: set[int] = set()
    for record in records:
        if record.kind == RecordKind.RESTART:
            ids.update(_meta(record).rolled_back)
    return ids


@dataclass
class _Replay:
    """Applies records to ``state`` one by one, recording what it did in ``replayed``."""

    state: RunState
    replayed: Replayed
    weight_version: int | None  # the trainer's: commits past it are rolled back
    previously: set[int]  # commits an earlier restore rolled back

    def apply(self, record: Record) -> None:
        meta = _meta(record)
        try:
            self._apply(record, meta)
        except JournalCorrupt:
            raise
        except RollsafeError as exc:
            raise JournalCorrupt(f"{_where(record)} does not fit the restored run: {exc}") from None
        self.replayed.applied += 1

    def _apply(self, record: Record, meta: Any) -> None:
        state = self.state
        match record.kind:
            case RecordKind.HANDOUT:
                state.handout(meta.groups)
            case RecordKind.DISPATCH:
                self._dispatch(meta)
            case RecordKind.SEAL:
                assert record.row is not None  # the format gives a seal its row
                state.seal(meta.group, meta.sibling, meta.attempt, record.row)
                self._touch(meta.group, [meta.sibling])
            case RecordKind.CLAIM:
                state.claim(meta.groups, meta.step)
            case RecordKind.COMMIT:
                self._commit(record.id, meta)
            case RecordKind.EVICT:
                self._touch(meta.group)
                state.evict(meta.group)
            case RecordKind.WEIGHT_VERSION:
                cap = self.weight_version
                state.set_weight_version(meta.version if cap is None else min(meta.version, cap))
            case RecordKind.RESTART:
                self._restart(record.id, meta)

    def _dispatch(self, meta: RolloutMeta) -> None:
        attempt = self.state.ledger.attempt(meta.group, meta.sibling)
        if attempt != meta.attempt:
            raise JournalCorrupt(
                f"dispatch of rollout {meta.group}/{meta.sibling} attempt {meta.attempt}: the "
                f"ledger is at attempt {attempt}"
            )
        self.state.dispatch(meta.group, meta.sibling, meta.owner)
        self._touch(meta.group, [meta.sibling])

    def _commit(self, record_id: int, meta: CommitMeta) -> None:
        cap = self.weight_version
        if record_id in self.previously or (cap is not None and self.state.weight_version >= cap):
            self.replayed.rolled_back.append(record_id)
            self.replayed.rolled_back_groups += meta.groups
            return
        for idx in meta.groups:
            self._touch(idx)
        self.state.commit_step(meta.groups)

    def _restart(self, record_id: int, meta: RestartMeta) -> None:
        if meta.why == "start_over":
            raise JournalCorrupt(
                f"the run started over after this snapshot (journal record {record_id}): "
                "restore a snapshot taken since"
            )
        envs = meta.environments()
        for episode in (*envs.episodes, *envs.refused):
            self._touch(episode.rollout.group.idx, [episode.rollout.i])
        for idx in self.state.restartable():
            self._touch(idx, self.state.ledger.unsealed(idx))
        self.state.restart(envs)

    def _touch(self, idx: int, siblings: Iterable[int] | None = None) -> None:
        """The journal changed these rollouts (default: the whole group) after the snapshot."""
        if siblings is None:
            siblings = range(self.state.config.group_size)
        self.replayed.touched.update((idx, i) for i in siblings)
