"""Restore = newest snapshot + the journal after it: everything sealed, handed out, claimed,
trained and evicted after the snapshot comes back; commits past the trainer's weights are
rolled back; a restore is itself replayed the same way; bad journals are stopped at or
refused with nothing applied from the bad record on and nothing changed on disk."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import fsspec
import numpy as np
import pytest

from rollsafe.checkpoint import restore as restore_module
from rollsafe.checkpoint.controller import Controller
from rollsafe.core.columns import in_key_order
from rollsafe.core.config import RunConfig
from rollsafe.core.phases import RestorePlan, RestoreRequest
from rollsafe.core.run_state import ROLLOUT_PARTITION, EnvironmentsRestored, RunState
from rollsafe.core.states import GroupState
from rollsafe.dataplane import make_dataplane
from rollsafe.errors import JournalCorrupt, JournalGap, LedgerInvariantViolation, NoValidSnapshot
from rollsafe.evidence.scenario import commit_rollout, row_content
from rollsafe.journal.format import RecordKind, encode_header, new_journal_id
from rollsafe.journal.run import JOURNAL_DIR, RunJournal
from rollsafe.journal.segments import SUFFIX, read_journal, segment_name
from rollsafe.snapshot import SnapshotStore, state_files
from rollsafe.snapshot.location import open_snapshot_store

RUN = "jr"


def config() -> RunConfig:
    return RunConfig(run_id=RUN, group_size=2, groups_per_step=2)


class Run:
    """A RunState with a journal and a snapshot store in ``root``; ``crash`` drops every
    object, ``restore`` starts from nothing but the disk."""

    def __init__(self, root: Path) -> None:
        self.store = SnapshotStore(root, RUN)
        self.journal = RunJournal.for_store(self.store, flush_ms=None)
        self.state = RunState(config(), make_dataplane("memory"))
        self.journal.start(self.state)
        self.checkpoints = 0

    def durable(self) -> None:
        self.journal.wait_durable(self.journal.last_id)

    def checkpoint(self) -> None:
        self.checkpoints += 1
        state_files.checkpoint(self.state, self.store, f"c-{self.checkpoints}")
        self.journal.compact(self.store)

    def crash(self) -> None:
        self.durable()  # everything acknowledged was durable
        self.journal.close()

    def restore(self, weight_version: int | None = None) -> RestorePlan:
        self.journal = RunJournal.for_store(self.store, flush_ms=None)
        state, plan = state_files.restore(
            config(),
            self.store,
            make_dataplane("memory"),
            journal=self.journal.replayer(weight_version),
        )
        self.journal.resume()
        self.state = state
        return plan

    @property
    def directory(self) -> Path:
        return self.store.run_dir / JOURNAL_DIR


def picture(run: RunState) -> tuple[object, ...]:
    """Everything a restore must bring back: ledger, index, loader, rows."""
    ledger = in_key_order(run.ledger.capture()[0])
    index = in_key_order(run.index.capture()[0])
    keys = sorted(
        run.row_key(idx, i) for idx in run.ledger.groups() for i in run.ledger.sealed(idx)
    )
    rows = run.dataplane.get(ROLLOUT_PARTITION, keys)
    return (
        {k: v.tobytes() for k, v in ledger.items()},
        {k: v.tobytes() for k, v in index.items()},
        run.loader_position,
        run.weight_version,
        {k: {name: array.tobytes() for name, array in rows[k].items()} for k in keys},
    )


def busy_after_a_checkpoint(tmp_path: Path) -> Run:
    """A snapshot with group 0 ready, then: groups 1-3 handed out, 1 sealed and claimed and
    trained, 2 sealed and evicted, 3 half sealed, 0 claimed."""
    run = Run(tmp_path)
    run.state.handout([0])
    commit_rollout(run.state, 0, 0)
    commit_rollout(run.state, 0, 1)
    run.checkpoint()
    run.state.handout([1, 2, 3])
    for idx in (1, 2):
        commit_rollout(run.state, idx, 0)
        commit_rollout(run.state, idx, 1)
    run.state.claim([1], step=0)
    run.state.commit_step([1])
    run.state.evict(2)
    commit_rollout(run.state, 3, 0)
    run.state.dispatch(3, 1)
    run.state.claim([0], step=1)
    return run


def test_a_crash_between_snapshots_restores_every_change_after_the_snapshot(tmp_path: Path) -> None:
    run = busy_after_a_checkpoint(tmp_path)
    before = picture(run.state)
    run.crash()
    plan = run.restore()
    assert run.journal.replayed is not None and run.journal.replayed.applied > 10
    after = run.state
    # Sealed stays sealed, trained stays trained, evicted stays evicted.
    assert after.ledger.sealed(3) == [0] and 1 not in after.index and 2 not in after.index
    assert after.weight_version == 1 and after.loader_position == 4
    # Claims of an uncommitted step come back ready; the dispatched rollout is owed.
    assert plan.released_claims == [0] and after.index.state(0) == GroupState.READY
    assert plan.partial[3].regenerate == [1] and plan.partial[3].restored == [0]
    # Apart from the restart's own changes, the state is the one before the crash.
    assert picture(after)[2:] == before[2:]


def test_a_second_crash_replays_the_first_restore_the_same_way(tmp_path: Path) -> None:
    run = busy_after_a_checkpoint(tmp_path)
    run.crash()
    run.restore()
    commit_rollout(run.state, 3, 1)  # the owed rollout, generated again after the restore
    before = picture(run.state)
    run.crash()
    run.restore()
    assert picture(run.state) == before
    assert run.state.index.state(3) == GroupState.READY


def test_a_restore_that_moved_an_episode_off_a_lost_instance_replays_the_same_way(
    tmp_path: Path,
) -> None:
    turn = config().model_copy(update={"restore_level": "turn"})
    run = Run(tmp_path)
    run.state = RunState(turn, make_dataplane("memory"))
    run.journal.start(run.state)
    run.state.handout([0])
    lost = run.state.dispatch(0, 1, owner="w-lost")
    run.checkpoint()
    run.crash()
    moved = EnvironmentsRestored({lost: "w0"}, moved=frozenset({lost}), lost={"w-lost": "gone"})
    run.journal = RunJournal.for_store(run.store, flush_ms=None)
    run.state, plan = state_files.restore(
        turn, run.store, make_dataplane("memory"),
        environments=moved, journal=run.journal.replayer(None),
    )  # fmt: skip
    run.journal.resume()
    assert plan.partial[0].resumed == [1] and plan.environments_lost == {"w-lost": "gone"}
    assert run.state.ledger.owner(0, 1) == "w0"
    before = picture(run.state)
    run.crash()
    run.journal = RunJournal.for_store(run.store, flush_ms=None)
    run.state, _ = state_files.restore(
        turn, run.store, make_dataplane("memory"), journal=run.journal.replayer(None)
    )
    assert picture(run.state) == before  # replayed: owned by w0, not refused as a stranger


def test_commits_past_the_trainers_weights_are_rolled_back_with_their_rows(tmp_path: Path) -> None:
    run = busy_after_a_checkpoint(tmp_path)
    run.crash()
    plan = run.restore(weight_version=0)  # the trainer lost step 0
    assert run.state.weight_version == 0
    assert plan.released_claims == [0, 1]  # group 1 trained by the rolled-back step
    assert run.journal.replayed is not None and run.journal.replayed.rolled_back_groups == [1]
    keys = [run.state.row_key(1, i) for i in (0, 1)]
    got = run.state.dataplane.get(ROLLOUT_PARTITION, keys)
    assert got[keys[0]]["tokens"].tobytes() == row_content(1, 0, 0)["tokens"].tobytes()
    # The next crash replays the rollback too (the restore's record names it).
    run.crash()
    run.restore()
    assert run.state.weight_version == 0 and run.state.index.state(1) == GroupState.READY


def test_weights_the_journal_never_reached_are_refused(tmp_path: Path) -> None:
    run = busy_after_a_checkpoint(tmp_path)
    run.crash()
    with pytest.raises(NoValidSnapshot, match="reaches weight version 1, not the 5"):
        run.restore(weight_version=5)


def test_a_torn_last_record_stops_the_replay_and_changes_nothing_on_disk(tmp_path: Path) -> None:
    run = busy_after_a_checkpoint(tmp_path)
    run.crash()
    segment = sorted(run.directory.glob(f"*{SUFFIX}"))[-1]
    whole = segment.read_bytes()
    segment.write_bytes(whole[:-5])  # the last record (the claim of group 0) torn
    plan = run.restore()
    assert plan.journal is None  # the plan's journal summary is the controller's addition
    replayed = run.journal.replayed
    assert replayed is not None and replayed.stop is not None
    assert replayed.stop.reason == "torn"
    assert segment.read_bytes() == whole[:-5]  # untouched
    assert run.state.index.state(0) == GroupState.READY and plan.released_claims == []
    # The run goes on after the stop, and the next restore reads past the torn tail.
    commit_rollout(run.state, 3, 1)
    run.crash()
    run.restore()
    assert run.state.index.state(3) == GroupState.READY


def test_a_flipped_byte_stops_at_its_record_and_nothing_after_it_is_applied(tmp_path: Path) -> None:
    run = busy_after_a_checkpoint(tmp_path)
    run.crash()
    segment = sorted(run.directory.glob(f"*{SUFFIX}"))[-1]
    data = bytearray(segment.read_bytes())
    records = read_journal(run.directory, RUN).records
    evict = next(r for r in records if r.kind.name == "EVICT")
    # Find the evict record's frame: flip a byte inside it.
    at = bytes(data).index(b'{"group":2}')
    data[at + 3] ^= 0xFF
    segment.write_bytes(bytes(data))
    run.restore()
    replayed = run.journal.replayed
    assert replayed is not None and replayed.stop is not None
    assert replayed.stop.reason == "corrupt" and "checksum" in replayed.stop.detail
    assert replayed.last_id == evict.id - 1
    assert 2 in run.state.index  # the eviction and everything after it: not applied
    assert run.state.ledger.sealed(3) == []


def test_a_segment_of_another_run_is_refused_and_the_fence_stays_up(tmp_path: Path) -> None:
    run = busy_after_a_checkpoint(tmp_path)
    run.crash()
    stranger = run.directory / segment_name(10_000)
    stranger.write_bytes(encode_header("other-run", 10_000, new_journal_id()))
    listing = sorted((p.name, p.read_bytes()) for p in run.directory.iterdir())
    controller = Controller(config(), tmp_path)
    assert controller.status().awaiting_restore
    with pytest.raises(JournalCorrupt, match="a segment of run 'other-run'"):
        controller.restore(RestoreRequest(run_id=RUN, restore_id="r1"))
    assert controller.status().awaiting_restore
    assert sorted((p.name, p.read_bytes()) for p in run.directory.iterdir()) == listing


def test_a_journal_that_does_not_continue_the_snapshot_is_refused(tmp_path: Path) -> None:
    run = busy_after_a_checkpoint(tmp_path)
    run.state.handout([4])
    run.checkpoint()  # covers everything so far; the journal goes on in a new segment
    run.state.handout([5])
    run.crash()
    segments = sorted(run.directory.glob(f"*{SUFFIX}"))
    # Name the last segment as if records were missing before it.
    last = segments[-1]
    first = int(last.name.removesuffix(SUFFIX))
    data = last.read_bytes()
    read = read_journal(run.directory, RUN)
    assert read.records[-1].id >= first and read.journal_id is not None
    moved = run.directory / segment_name(first + 3)
    header_len = len(encode_header(RUN, first, read.journal_id))
    moved.write_bytes(encode_header(RUN, first + 3, read.journal_id) + data[header_len:])
    last.unlink()
    with pytest.raises(JournalGap, match=rf"starts at record {first + 3}"):
        run.restore()


def test_compaction_deletes_only_what_every_retained_snapshot_covers(tmp_path: Path) -> None:
    run = Run(tmp_path)  # keep_latest_k 2 (the default)
    for idx in range(4):
        run.state.handout([idx])
        commit_rollout(run.state, idx, 0)
        run.checkpoint()
    firsts = [int(p.name.removesuffix(SUFFIX)) for p in sorted(run.directory.glob("*" + SUFFIX))]
    positions = sorted(m.counts["journal_position"] for m in run.store.published_manifests())
    assert len(positions) == 2
    # Every record after the oldest retained snapshot is still there, nothing much older.
    assert firsts[0] <= positions[0] + 1
    assert len(firsts) <= 3
    run.crash()
    run.restore()
    assert run.state.ledger.sealed(3) == [0]


def test_a_seal_is_acknowledged_only_once_its_record_is_durable(tmp_path: Path) -> None:
    entered, release = threading.Event(), threading.Event()
    syncs = {"n": 0}

    def gated_fsync(descriptor: int) -> None:
        syncs["n"] += 1
        if armed.is_set():
            entered.set()
            release.wait(timeout=30)

    armed = threading.Event()
    store = SnapshotStore(tmp_path, RUN)
    journal = RunJournal(store.run_dir / JOURNAL_DIR, RUN, flush_ms=1.0, fsync=gated_fsync)
    controller = Controller.from_parts(
        RunState(config(), make_dataplane("memory")), store, journal=journal
    )
    controller.handout([0])
    episode = controller.dispatch(0, 0)
    assert episode is not None
    armed.set()
    answers: list[bool] = []
    sealer = threading.Thread(
        target=lambda: answers.append(
            controller.seal(0, 0, episode.attempt, row_content(0, 0, episode.attempt))
        )
    )
    sealer.start()
    assert entered.wait(timeout=30)
    assert answers == [] and sealer.is_alive()  # held in the batch's fsync: not told yet
    armed.clear()
    release.set()
    sealer.join(timeout=30)
    assert answers == [True]
    assert np.array_equal(
        read_journal(store.run_dir / JOURNAL_DIR, RUN).records[-1].row["tokens"],  # type: ignore[index]
        row_content(0, 0, 0)["tokens"],
    )
    journal.close()


class Placing:
    """Participants that only place episodes (the restore's environment step is replaced)."""

    def instance_for(self, placement: int) -> str:
        return "w0"


def failing_environments(*_: object) -> NoReturn:
    """The environments fail the restore after the journal replayed."""
    raise LedgerInvariantViolation("w0 restored an episode the run does not own")


def test_a_restore_failing_after_the_replay_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = busy_after_a_checkpoint(tmp_path)
    run.crash()
    listing = sorted((p.name, p.read_bytes()) for p in run.directory.iterdir())
    monkeypatch.setattr(restore_module, "restore_envs", failing_environments)
    controller = Controller(config(), tmp_path, participants=Placing())  # type: ignore[arg-type]
    with pytest.raises(LedgerInvariantViolation):
        controller.restore(RestoreRequest(run_id=RUN, restore_id="r1"))
    assert controller.status().awaiting_restore
    assert sorted((p.name, p.read_bytes()) for p in run.directory.iterdir()) == listing
    # The same restore without the failure: the plan says what the journal gave back.
    plan = Controller(config(), tmp_path).restore(RestoreRequest(run_id=RUN, restore_id="r2"))
    assert plan.journal is not None and plan.journal.records > 10 and plan.journal.stop is None


@pytest.fixture
def bucket() -> Iterator[str]:
    """A fresh memory:// bucket (object storage in this process), removed afterwards."""
    url = f"memory://journal-{uuid.uuid4().hex[:12]}/snaps"
    try:
        yield url
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)


def test_on_object_storage_a_lost_machine_loses_only_what_was_not_mirrored(
    tmp_path: Path, bucket: str
) -> None:
    store = open_snapshot_store(bucket, RUN, cache_dir=tmp_path / "host-a")
    journal = RunJournal.for_store(store, flush_ms=None, mirror_every_s=None)
    state = RunState(config(), make_dataplane("memory"))
    journal.start(state)
    state.handout([0, 1])
    commit_rollout(state, 0, 0)
    state_files.checkpoint(state, store, "c-1")
    journal.compact(store)
    commit_rollout(state, 0, 1)
    commit_rollout(state, 1, 0)
    journal.wait_durable(journal.last_id)
    assert journal.mirror_now() == 1  # compaction copied the segment it closed; this one now
    commit_rollout(state, 1, 1)  # durable on host a's disk only: lost with the machine
    journal.wait_durable(journal.last_id)
    journal.close()

    elsewhere = open_snapshot_store(bucket, RUN, cache_dir=tmp_path / "host-b")
    again = RunJournal.for_store(elsewhere, flush_ms=None, mirror_every_s=None)
    restored, plan = state_files.restore(
        config(), elsewhere, make_dataplane("memory"), journal=again.replayer()
    )
    again.resume()
    assert restored.ledger.sealed(0) == [0, 1] and restored.ledger.sealed(1) == [0]
    assert plan.ready == [0] and plan.partial[1].regenerate == [1]
    # The run goes on on host b; its next mirror copies the new segment too.
    commit_rollout(restored, 1, 1)
    assert again.mirror_now() == 1
    again.close()


def test_a_record_whose_metadata_does_not_fit_is_refused_by_id(tmp_path: Path) -> None:
    run = busy_after_a_checkpoint(tmp_path)
    bad = run.journal.append(RecordKind.HANDOUT, {"groups": [9], "colour": "red"})
    run.crash()
    with pytest.raises(JournalCorrupt, match=rf"journal record {bad} \(handout\).*colour"):
        run.restore()


def test_a_record_that_does_not_fit_the_restored_run_is_refused(tmp_path: Path) -> None:
    run = busy_after_a_checkpoint(tmp_path)
    # A seal of a rollout the run never handed out (written by something else).
    row = row_content(50, 0, 0)
    bad = run.journal.append(RecordKind.SEAL, {"group": 50, "sibling": 0, "attempt": 0}, row)
    run.crash()
    with pytest.raises(JournalCorrupt, match=rf"journal record {bad} \(seal\) does not fit"):
        run.restore()
