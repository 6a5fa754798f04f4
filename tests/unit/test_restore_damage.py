"""What a restore does with damage (docs/journal.md, docs/snapshot-format.md): one regression
test per class issue 32 found. Nothing a restore could not read is dropped without a word or
written over; everything is a named refusal, a reported stop, or the identical state."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollsafe.checkpoint.preview import preview_restore
from rollsafe.cli.app import app
from rollsafe.core.config import RunConfig
from rollsafe.core.phases import RestorePlan
from rollsafe.core.run_state import JOURNAL_POSITION, RunState
from rollsafe.dataplane import make_dataplane
from rollsafe.errors import (
    JournalCorrupt,
    JournalGap,
    NoValidSnapshot,
    RowMismatch,
    SnapshotCorrupt,
)
from rollsafe.evidence.scenario import commit_rollout
from rollsafe.journal.run import JOURNAL_DIR, SET_ASIDE_DIR, RunJournal
from rollsafe.journal.segments import SUFFIX, read_journal
from rollsafe.snapshot import MANIFEST_NAME, SnapshotStore, state_files
from rollsafe.snapshot.tensorfile import HashingWriter, read_tensors, write_tensors
from rollsafe.testing.damage import DEEP, replace_resealed

RUN = "dmg"
CONFIG = RunConfig(run_id=RUN, group_size=2, groups_per_step=1)


class Run:
    """A run with a journal under ``root``: ``crash`` drops every object, ``restore`` starts
    from nothing but the disk (as a new process does)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = SnapshotStore(root, RUN)
        self.journal = RunJournal.for_store(self.store, flush_ms=None, mirror_every_s=None)
        self.state = RunState(CONFIG, make_dataplane("memory"))
        self.journal.start(self.state)
        self.checkpoints = 0

    @property
    def folder(self) -> Path:
        return self.store.run_dir / JOURNAL_DIR

    def segments(self) -> list[Path]:
        return sorted(self.folder.glob(f"*{SUFFIX}"))

    def checkpoint(self) -> None:
        self.checkpoints += 1
        state_files.checkpoint(self.state, self.store, f"c-{self.checkpoints}")
        self.journal.compact(self.store)

    def crash(self) -> None:
        self.journal.wait_durable(self.journal.last_id)
        self.journal.close()

    def restore(self, *, accept_loss: bool = False) -> RestorePlan:
        self.journal = RunJournal.for_store(self.store, flush_ms=None, mirror_every_s=None)
        try:
            self.state, plan = state_files.restore(
                CONFIG,
                self.store,
                make_dataplane("memory"),
                journal=self.journal.replayer(accept_loss=accept_loss),
            )
        except BaseException:
            self.journal.abandon_restore()
            raise
        self.journal.resume()
        assert self.journal.replayed is not None
        return plan.model_copy(update={"journal": self.journal.replayed.summary()})


def busy(root: Path) -> Run:
    """A snapshot, then seals in a new segment: the journal's records after the snapshot are
    what a restore must bring back."""
    run = Run(root)
    run.state.handout([0, 1])
    commit_rollout(run.state, 0, 0)
    run.checkpoint()
    for idx, i in ((0, 1), (1, 0), (1, 1)):
        commit_rollout(run.state, idx, i)
    run.crash()
    return run


def tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def corrupt_record(segment: Path, n: int) -> bytes:
    """Flip a byte inside record ``n`` (0: the first) of ``segment``; its bytes, as damaged."""
    read = read_journal(segment.parent, RUN)
    ours = [r for r in read.records if r.id >= int(segment.name.removesuffix(SUFFIX))]
    meta = json.dumps(dict(ours[n].meta), separators=(",", ":")).encode()
    data = bytearray(segment.read_bytes())
    data[data.index(meta) + 2] ^= 0xFF
    segment.write_bytes(bytes(data))
    return bytes(data)


# ---- 1. the journal: nothing dropped without a word, nothing overwritten --------------------


def test_a_corrupt_first_record_is_a_reported_stop_and_its_segment_stays_whole(
    tmp_path: Path,
) -> None:
    run = busy(tmp_path)
    segment = run.segments()[-1]
    damaged = corrupt_record(segment, 0)
    plan = run.restore()
    assert plan.journal is not None and plan.journal.stop is not None
    (stop,) = plan.journal.stops
    assert (stop.segment, stop.reason, stop.superseded) == (segment.name, "corrupt", False)
    assert stop.record == int(segment.name.removesuffix(SUFFIX))
    assert segment.read_bytes() == damaged  # never truncated or overwritten
    assert run.state.ledger.sealed(0) == [0]  # the snapshot's state: nothing after the stop
    # The run goes on in a new segment above it; the stop is reported by every later restore.
    commit_rollout(run.state, 0, 1)
    run.crash()
    for _ in range(2):
        again = run.restore()
        assert again.journal is not None
        assert [(s.segment, s.superseded) for s in again.journal.stops] == [(segment.name, True)]
        assert run.state.ledger.sealed(0) == [0, 1]
        assert segment.read_bytes() == damaged
        run.crash()


def test_a_stop_before_a_later_restores_segment_stays_reported(tmp_path: Path) -> None:
    run = busy(tmp_path)
    segment = run.segments()[-1]
    corrupt_record(segment, 1)  # records after the first are lost to this restore
    first = run.restore()
    assert first.journal is not None and first.journal.records == 1
    commit_rollout(run.state, 1, 0)
    run.crash()
    second = run.restore()
    assert second.journal is not None and second.journal.stop is None
    assert [s.record for s in second.journal.stops] == [first.journal.stops[0].record]
    # The first restore's RESTART, then the dispatch and the seal after it.
    assert second.journal.records == first.journal.records + 3


def test_compaction_sets_a_damaged_segment_aside_rather_than_deleting_it(tmp_path: Path) -> None:
    run = busy(tmp_path)
    segment = run.segments()[-1]
    damaged = corrupt_record(segment, 1)
    run.restore()
    for _ in range(3):  # every retained snapshot covers it now
        run.checkpoint()
    assert not segment.exists()
    assert (run.folder / SET_ASIDE_DIR / segment.name).read_bytes() == damaged


@pytest.mark.parametrize("what", ["newest segment", "HEAD", "journal folder"])
def test_a_missing_part_of_the_journal_is_a_named_refusal_unless_the_loss_is_accepted(
    tmp_path: Path, what: str
) -> None:
    run = busy(tmp_path)
    if what == "newest segment":
        run.segments()[-1].unlink()
    elif what == "HEAD":
        (run.folder / "HEAD").unlink()
    else:
        for path in run.folder.iterdir():
            path.unlink()
        run.folder.rmdir()
    before = tree(tmp_path)
    with pytest.raises(JournalGap, match="missing"):
        run.restore()
    assert tree(tmp_path) == before  # a refused restore writes nothing
    plan = run.restore(accept_loss=True)
    assert plan.journal is not None and plan.journal.accepted_loss
    assert "missing" in plan.journal.accepted_loss[0]
    # What the restore accepted is in its own record: the next restore replays it quietly.
    run.crash()
    again = run.restore()
    assert again.journal is not None and again.journal.accepted_loss == []


def test_a_journal_of_another_run_with_the_same_id_is_refused(tmp_path: Path) -> None:
    ours = busy(tmp_path / "ours")
    theirs = busy(tmp_path / "theirs")
    for path in ours.folder.iterdir():
        path.unlink()
    for path in theirs.folder.iterdir():
        (ours.folder / path.name).write_bytes(path.read_bytes())
    with pytest.raises(JournalGap, match=r"covers journal [0-9a-f]{32} up to record"):
        ours.restore()
    plan = ours.restore(accept_loss=True)  # the snapshot alone; their segments set aside
    assert ours.state.ledger.sealed(0) == [0] and ours.state.ledger.sealed(1) == []
    assert plan.journal is not None and plan.journal.records == 0
    assert sorted(p.name for p in (ours.folder / SET_ASIDE_DIR).iterdir()) == sorted(
        p.name for p in theirs.folder.glob(f"*{SUFFIX}")
    )


def test_an_edited_journal_position_is_refused_by_the_manifests_digest(tmp_path: Path) -> None:
    run = busy(tmp_path)
    snapshot = next(run.store.snapshots_dir.iterdir())
    manifest = json.loads((snapshot / MANIFEST_NAME).read_bytes())
    manifest["counts"][JOURNAL_POSITION] += 2  # would skip two records
    (snapshot / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(NoValidSnapshot, match="its digest does not match its fields"):
        run.restore()


# ---- 2. snapshots: a chimera or an edited ledger entry is refused by name -------------------


def two_snapshots(root: Path) -> tuple[Run, Path, Path]:
    """The older snapshot owns group 0 of the three handed out (1 and 2 evicted); the newer
    owns group 3 alone (0 evicted since), at loader position 4."""
    run = Run(root)
    run.state.handout([0, 1, 2])
    run.state.evict(1)
    run.state.evict(2)
    run.checkpoint()
    run.state.handout([3])
    run.state.evict(0)
    run.checkpoint()
    run.crash()
    older, newer = sorted(run.store.snapshots_dir.iterdir())
    return run, older, newer


@pytest.mark.parametrize(
    ("relpath", "named"),
    [
        ("loader.json", "loader.json disagrees with the manifest"),
        ("replay_index.safetensors", "ledger and replay index disagree: only in ledger [3]"),
        ("ledger.safetensors", "ledger and replay index disagree: only in ledger [0]"),
    ],
)
def test_a_snapshot_assembled_from_two_snapshots_is_refused_naming_what_disagrees(
    tmp_path: Path, relpath: str, named: str
) -> None:
    run, older, newer = two_snapshots(tmp_path)
    replace_resealed(newer, relpath, (older / relpath).read_bytes())
    with pytest.raises(SnapshotCorrupt) as refused:
        run.restore()
    assert newer.name in str(refused.value) and named in str(refused.value)


def test_a_newer_loader_over_an_older_index_is_refused_before_groups_go_missing(
    tmp_path: Path,
) -> None:
    # Group 3 handed out, in neither the older ledger nor its index: with the newer loader
    # (manifest and all made to agree) it would never be generated, nor ever be owed.
    run, older, newer = two_snapshots(tmp_path)
    loader = (newer / "loader.json").read_bytes()
    manifest = json.loads((older / MANIFEST_NAME).read_bytes())
    manifest["loader_position"] = json.loads(loader)["position"]
    (older / MANIFEST_NAME).write_text(json.dumps(manifest))
    replace_resealed(older, "loader.json", loader)
    shutil.rmtree(newer)
    with pytest.raises(SnapshotCorrupt, match="handed out 4 groups; the replay index accounts "
                       r"for 3 \(1 owned, 0 trained, 2 evicted\)"):  # fmt: skip
        run.restore()


def test_a_sealed_rollouts_attempt_edited_in_the_ledger_is_refused(tmp_path: Path) -> None:
    run = busy(tmp_path)
    snapshot = next(run.store.snapshots_dir.iterdir())
    arrays, metadata = read_tensors((snapshot / "ledger.safetensors").read_bytes(), "ledger")
    arrays = {name: array.copy() for name, array in arrays.items()}
    arrays["attempt"][0, 0] += 1  # group 0, sibling 0: sealed by attempt 0
    out = io.BytesIO()
    write_tensors(HashingWriter(out), arrays, metadata)
    replace_resealed(snapshot, "ledger.safetensors", out.getvalue())
    with pytest.raises(RowMismatch, match=rf"group 0 rollout 0 .*snapshot {snapshot.name}"):
        run.restore()


# ---- 3. no crash, no hang, no unbounded read: a named refusal --------------------------------


@pytest.mark.parametrize("target", ["manifest.json", "LATEST", "ledger.safetensors", "HEAD"])
def test_json_nested_thousands_deep_is_refused_by_name(tmp_path: Path, target: str) -> None:
    run = busy(tmp_path)
    snapshot = next(run.store.snapshots_dir.iterdir())
    deep = b"[" * 1000 + b"]" * 1000  # five times a bounded parser's depth, within every size
    if target == "ledger.safetensors":  # its digests made to match, so that it is parsed
        replace_resealed(snapshot, target, len(deep).to_bytes(8, "little") + deep)
    else:
        path = {"LATEST": run.store.run_dir, "HEAD": run.folder}.get(target, snapshot) / target
        path.write_bytes(deep)
    if target == "manifest.json":
        with pytest.raises(NoValidSnapshot, match=r"manifest.json: not valid JSON \(recursion"):
            run.restore()
    elif target == "ledger.safetensors":
        with pytest.raises(SnapshotCorrupt, match=r"ledger.safetensors: unreadable header \(rec"):
            run.restore()
    elif target == "HEAD":
        with pytest.raises(JournalGap, match=r"HEAD: unreadable \(recursion limit"):
            run.restore()
    else:
        plan = run.restore()  # LATEST is a cross-check: the snapshot is there anyway
        assert plan.snapshot == snapshot.name


@pytest.mark.parametrize("what", ["folder", "fifo", "link to /dev/zero"])
def test_something_not_a_file_named_like_a_segment_is_refused_at_once(
    tmp_path: Path, what: str
) -> None:
    run = busy(tmp_path)
    odd = run.folder / f"{10**9:020d}{SUFFIX}"
    if what == "folder":
        odd.mkdir()
    elif what == "fifo":
        os.mkfifo(odd)
    else:
        odd.symlink_to("/dev/zero")
    with pytest.raises(JournalGap, match=rf"{odd.name}: unreadable"):
        run.restore()


def test_a_journal_folder_that_is_a_file_is_refused_by_name(tmp_path: Path) -> None:
    run = busy(tmp_path)
    for path in run.folder.iterdir():
        path.unlink()
    run.folder.rmdir()
    run.folder.write_bytes(b"not a folder")
    with pytest.raises(JournalCorrupt, match="journal's place holds something not a folder"):
        run.restore(accept_loss=True)  # no choice can make a file a folder


def test_one_bad_snapshot_leaves_the_listing_of_the_others_whole(tmp_path: Path) -> None:
    run = busy(tmp_path)
    run.restore()
    run.checkpoint()
    bad, good = sorted(run.store.snapshots_dir.iterdir())
    (bad / MANIFEST_NAME).write_bytes(b"[" * DEEP + b"]" * DEEP)
    result = CliRunner().invoke(app, ["ls", RUN, "--root", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)["snapshots"]}
    assert rows[good.name]["state"] == "valid"
    assert rows[bad.name]["state"] == "invalid" and "recursion limit" in rows[bad.name]["reason"]


# ---- restore plan: offline, nothing written ---------------------------------------------------


def test_restore_plan_says_what_a_restore_would_do_and_changes_nothing(tmp_path: Path) -> None:
    run = busy(tmp_path)
    corrupt_record(run.segments()[-1], 2)
    before = tree(tmp_path)
    preview = preview_restore(SnapshotStore(tmp_path, RUN))
    assert preview.restorable and preview.plan is not None and preview.plan.journal is not None
    assert preview.plan.journal.records == 2 and preview.plan.journal.stops[0].record > 0
    result = CliRunner().invoke(app, ["restore", "plan", RUN, "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "would be restored from 00000001-rollout" in result.stdout
    assert "journal stop:" in result.stdout and "corrupt" in result.stdout
    assert tree(tmp_path) == before
    # A refusal is exit 1 naming it; accepting the loss shows what would be given up.
    run.segments()[-1].unlink()
    refused = CliRunner().invoke(app, ["restore", "plan", RUN, "--root", str(tmp_path), "--json"])
    assert refused.exit_code == 1 and "would be refused: JournalGap" in refused.stderr
    assert json.loads(refused.stdout)["refused"].startswith("JournalGap")
    accepted = CliRunner().invoke(
        app, ["restore", "plan", RUN, "--root", str(tmp_path), "--accept-journal-loss"]
    )
    assert accepted.exit_code == 0 and "journal loss accepted:" in accepted.stdout
    assert not (run.folder / SET_ASIDE_DIR).exists()
