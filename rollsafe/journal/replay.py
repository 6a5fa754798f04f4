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
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollsafe.core.ids import EpisodeId
from rollsafe.core.phases import JournalReplayed
from rollsafe.core.run_state import EnvironmentsRestored, RunState
from rollsafe.errors import JournalCorrupt, NoValidSnapshot, RollsafeError
from rollsafe.journal.format import Record, RecordKind, Stop
from rollsafe.journal.segments import JournalRead

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
    stop: Stop | None = None
    stopped_in: str | None = None

    def summary(self) -> JournalReplayed:
        stop = None
        if self.stop is not None:
            stop = (
                f"{self.stopped_in}: {self.stop.reason} record at offset {self.stop.offset} "
                f"({self.stop.detail})"
            )
        return JournalReplayed(
            covered=self.covered,
            records=self.applied,
            last_id=self.last_id,
            rolled_back_groups=sorted(self.rolled_back_groups),
            stop=stop,
        )

    def changed(self, episode: EpisodeId) -> bool:
        """Whether the journal changed this episode's rollout after the snapshot (sealed,
        dispatched again, restarted, or its group trained or evicted)."""
        return (episode.rollout.group.idx, episode.rollout.i) in self.touched


def replay(
    state: RunState,
    read: JournalRead,
    covered: int | None,
    snapshot: str,
    weight_version: int | None = None,
) -> Replayed:
    """Apply the records of ``read`` after ``covered`` (the snapshot's journal position;
    None: the snapshot was taken without a journal) to ``state``. ``weight_version``: the
    weights the trainer restored; commits past them are rolled back (None: every commit
    stands). :class:`JournalCorrupt` when the journal does not continue the snapshot or a
    record does not fit the state it is applied to."""
    if covered is None:
        if read.records:
            raise JournalCorrupt(
                f"snapshot {snapshot} names no journal position (taken with the journal off) "
                f"and the journal holds records {read.records[0].id}..{read.records[-1].id}: "
                "it cannot be replayed onto it; restore with the journal off, or remove the "
                "journal's folder to restore the snapshot alone"
            )
        covered = 0
    after = [record for record in read.records if record.id > covered]
    if after and after[0].id != covered + 1 and not _restarts(after[0]):
        raise JournalCorrupt(
            f"snapshot {snapshot} covers the journal up to record {covered} but the journal "
            f"goes on at record {after[0].id}: records {covered + 1}..{after[0].id - 1} are "
            "missing"
        )
    replayed = Replayed(
        covered=covered,
        last_id=max(covered, read.end or 0),
        stop=read.stop,
        stopped_in=str(read.stopped_in) if read.stopped_in else None,
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
            snapshot,
            {
                snapshot: f"with the journal after it, the run reaches weight version "
                f"{state.weight_version}, not the {weight_version} the trainer restored",
            },
        )
    return replayed


def _restarts(record: Record) -> bool:
    """A segment a restore opened starts with its RESTART (its first id may skip ids the
    snapshot covered and the journal lost, or a torn tail)."""
    return record.kind == RecordKind.RESTART


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
