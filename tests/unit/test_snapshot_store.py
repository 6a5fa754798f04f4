"""Drafts, atomic publish, idempotent re-publish, retention, sweeping and crash points."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import rollsafe.snapshot
import rollsafe.snapshot.draft as draft_module
from rollsafe.core.ids import snapshot_dir_name
from rollsafe.errors import InvalidInput, NoValidSnapshot, SnapshotCorrupt
from rollsafe.snapshot import (
    FAULT_POINTS,
    MANIFEST_NAME,
    FileEntry,
    PublishedSnapshot,
    SnapshotDraft,
    SnapshotKind,
    SnapshotManifest,
    SnapshotStore,
)
from rollsafe.snapshot._fs import hash_file
from rollsafe.snapshot.tensorfile import read_tensors, write_tensors

RUN = "run-1"


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under ``root``: relpath -> sha256 of its bytes, or 'dir'."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def publish(
    store: SnapshotStore,
    checkpoint_id: str,
    seq: int | None = None,
    files: dict[str, bytes] | None = None,
    kind: SnapshotKind = SnapshotKind.ROLLOUT,
) -> PublishedSnapshot:
    draft = store.begin(kind, checkpoint_id, seq)
    for relpath, data in (files or {"state.bin": checkpoint_id.encode()}).items():
        draft.write_bytes(relpath, data)
    return draft.publish(weight_version=1, loader_position=10)


def entries(store: SnapshotStore) -> list[str]:
    """Everything in snapshots/ except retired snapshots waiting in trash for the next
    begin's sweep (retention only renames them, to keep deletion off the publish path)."""
    return sorted(p.name for p in store.snapshots_dir.iterdir() if not is_retired(p.name))


def is_retired(name: str) -> bool:
    return name.startswith(".trash-") and not name.startswith(".trash-.tmp-")


def test_publish_lists_every_file_and_points_latest(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    draft = store.begin(SnapshotKind.TRAINER, "ck-1", seq=4)
    assert draft.path.parent == store.snapshots_dir
    assert draft.path.name.startswith(".tmp-")
    draft.write_bytes("ledger.bin", b"ledger")
    draft.write_json("loader.json", {"position": 10})
    draft.write_json("nested/model.json", SnapshotKind.TRAINER.value)
    snap = draft.publish(weight_version=3, loader_position=10, anchor_step=7, counts={"groups": 2})

    assert snap.name == "00000004-trainer" and not snap.reused
    assert entries(store) == ["00000004-trainer"]
    on_disk = (snap.path / MANIFEST_NAME).read_bytes()
    manifest = SnapshotManifest.model_validate_json(on_disk)
    assert manifest == snap.manifest
    assert (manifest.seq, manifest.kind, manifest.checkpoint_id) == (4, "trainer", "ck-1")
    assert (manifest.anchor_step, manifest.weight_version, manifest.counts) == (7, 3, {"groups": 2})
    expected = {
        "ledger.bin": b"ledger",
        "loader.json": json.dumps({"position": 10}).encode(),
        "nested/model.json": b'"trainer"',
    }
    assert {k: (v.sha256, v.bytes) for k, v in manifest.files.items()} == {
        k: (sha(v), len(v)) for k, v in expected.items()
    }
    pointer = store.latest_pointer()
    assert pointer is not None
    assert (pointer.snapshot, pointer.seq, pointer.kind) == ("00000004-trainer", 4, "trainer")
    assert pointer.manifest_sha256 == sha(on_disk) == snap.manifest_sha256


def test_open_streams_through_a_hashing_writer(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    arrays = {"tokens": np.arange(12, dtype=np.int32).reshape(3, 4)}
    draft = store.begin("rollout", "ck-1")
    with draft.open("rows/tokens.safetensors") as out:
        write_tensors(out, arrays)
    snap = draft.publish(weight_version=0, loader_position=0)

    data = snap.reader().read_bytes("rows/tokens.safetensors")
    assert snap.manifest.files["rows/tokens.safetensors"].sha256 == sha(data)
    loaded, _meta = read_tensors(data, "tokens")
    np.testing.assert_array_equal(loaded["tokens"], arrays["tokens"])


def write_half_then_die(draft: SnapshotDraft) -> None:
    """A writer that dies after writing part of ``half.bin``."""
    with draft.open("half.bin") as out:
        out.write(b"partial")
        raise RuntimeError("writer died")


def test_a_failed_write_leaves_no_partial_file(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    draft = store.begin("rollout", "ck-1")
    with pytest.raises(RuntimeError, match="writer died"):
        write_half_then_die(draft)
    assert not (draft.path / "half.bin").exists()
    assert "half.bin" not in draft.files
    draft.write_bytes("half.bin", b"whole")  # the path is free again
    assert set(draft.publish(weight_version=0, loader_position=0).manifest.files) == {"half.bin"}


def test_record_hashes_files_another_component_wrote(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    draft = store.begin("rollout", "ck-1")
    export = draft.path / "dataplane"
    (export / "part-a").mkdir(parents=True)
    (export / "part-a" / "rows.bin").write_bytes(b"rows")
    (export / "index.json").write_bytes(b"{}")
    (draft.path / "envs.json").write_bytes(b"[]")

    assert draft.record("dataplane") == ["dataplane/index.json", "dataplane/part-a/rows.bin"]
    assert draft.record("envs.json") == ["envs.json"]
    files = draft.publish(weight_version=0, loader_position=0).manifest.files
    assert files["dataplane/part-a/rows.bin"].sha256 == sha(b"rows")
    assert files["envs.json"].bytes == 2


def test_no_file_is_hashed_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[Path] = []

    def counting(path: Path, *, sync: bool = False) -> FileEntry:
        hashed.append(path)
        return hash_file(path, sync=sync)

    monkeypatch.setattr(draft_module, "hash_file", counting)
    store = SnapshotStore(tmp_path, RUN)
    draft = store.begin("rollout", "ck-1")
    draft.write_bytes("out/own.bin", b"hashed while written")
    (draft.path / "out" / "theirs.bin").write_bytes(b"written by someone else")
    assert draft.record("out") == ["out/theirs.bin"]
    assert draft.record("out") == []
    draft.publish(weight_version=0, loader_position=0)
    assert hashed == [draft.path / "out" / "theirs.bin"]


def test_unrecorded_file_blocks_publish_and_names_it(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    draft = store.begin("rollout", "ck-1")
    draft.write_bytes("known.bin", b"k")
    (draft.path / "stray.bin").write_bytes(b"s")
    with pytest.raises(InvalidInput, match=r"unrecorded file\(s\).*stray\.bin"):
        draft.publish(weight_version=0, loader_position=0)
    assert entries(store) == [draft.path.name]  # nothing published
    draft.record("stray.bin")
    assert draft.publish(weight_version=0, loader_position=0).name == "00000001-rollout"


def test_file_changed_after_record_blocks_publish(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    draft = store.begin("rollout", "ck-1")
    draft.write_bytes("a.bin", b"abcdef")
    (draft.path / "a.bin").write_bytes(b"abc")
    with pytest.raises(InvalidInput, match=r"a\.bin: changed or removed"):
        draft.publish(weight_version=0, loader_position=0)


def test_symlinks_are_never_recorded_or_published(tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    store = SnapshotStore(tmp_path / "store", RUN)
    draft = store.begin("rollout", "ck-1")
    (draft.path / "link.bin").symlink_to(outside)
    with pytest.raises(InvalidInput, match="not a regular file"):
        draft.record("link.bin")
    with pytest.raises(InvalidInput, match="symlinks"):
        draft.publish(weight_version=0, loader_position=0)
    (draft.path / "sub").mkdir()
    (draft.path / "sub" / "link").symlink_to(outside)
    with pytest.raises(InvalidInput, match="sub/link"):
        draft.record("sub")


@pytest.mark.parametrize(
    "relpath", ["../escape.bin", "/tmp/abs.bin", "a/../../b", "manifest.json", "a//b", "a\\b"]
)
def test_unsafe_relpaths_are_refused(tmp_path: Path, relpath: str) -> None:
    store = SnapshotStore(tmp_path / "store", RUN)
    draft = store.begin("rollout", "ck-1")
    before = tree_digest(tmp_path)
    with pytest.raises(InvalidInput, match="invalid snapshot path"):
        draft.write_bytes(relpath, b"x")
    with pytest.raises(InvalidInput, match="invalid snapshot path"):
        draft.record(relpath)
    assert tree_digest(tmp_path) == before


def test_the_same_relpath_cannot_be_written_twice(tmp_path: Path) -> None:
    draft = SnapshotStore(tmp_path, RUN).begin("rollout", "ck-1")
    draft.write_bytes("a.bin", b"1")
    with pytest.raises(InvalidInput, match="already has a file"):
        draft.write_bytes("a.bin", b"2")
    with pytest.raises(InvalidInput, match="already recorded"):
        draft.record("a.bin")
    assert (draft.path / "a.bin").read_bytes() == b"1"


def test_write_json_refuses_what_json_cannot_hold(tmp_path: Path) -> None:
    draft = SnapshotStore(tmp_path, RUN).begin("rollout", "ck-1")
    with pytest.raises(InvalidInput, match="not JSON"):
        draft.write_json("a.json", {"x": float("nan")})
    with pytest.raises(InvalidInput, match="not JSON"):
        draft.write_json("b.json", {"x": object()})


def test_invalid_metadata_is_refused_before_anything_is_published(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    draft = store.begin("rollout", "ck-1")
    with pytest.raises(InvalidInput, match="weight_version"):
        draft.publish(weight_version=-1, loader_position=0)
    assert entries(store) == [draft.path.name]


def test_seq_defaults_to_one_more_than_the_highest_published(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN, keep_latest_k=5)
    assert publish(store, "ck-a").manifest.seq == 1
    assert publish(store, "ck-b", seq=7).manifest.seq == 7
    assert publish(store, "ck-c", kind=SnapshotKind.TRAINER).name == "00000008-trainer"


def test_republishing_the_same_checkpoint_returns_the_existing_snapshot(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    first = publish(store, "ck-1", seq=3, files={"a.bin": b"first"})
    before = tree_digest(store.snapshots_dir)
    again = publish(store, "ck-1", seq=3, files={"a.bin": b"second attempt"})
    assert again.reused and not first.reused
    assert again.path == first.path and again.manifest == first.manifest
    assert tree_digest(store.snapshots_dir) == before  # second draft removed, first untouched


def test_republishing_an_older_snapshot_leaves_latest_on_the_newest(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN, keep_latest_k=3)
    publish(store, "ck-3", seq=3)
    publish(store, "ck-4", seq=4)
    before = tree_digest(store.run_dir)
    late_retry = publish(store, "ck-3", seq=3)
    assert late_retry.reused and late_retry.name == "00000003-rollout"
    assert tree_digest(store.run_dir) == before
    pointer = store.latest_pointer()
    assert pointer is not None and pointer.snapshot == "00000004-rollout"


def test_another_checkpoint_cannot_take_a_published_seq(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    publish(store, "ck-1", seq=3)
    before = tree_digest(store.run_dir)
    draft = store.begin("rollout", "ck-2", seq=3)
    draft.write_bytes("state.bin", b"other")
    with pytest.raises(
        InvalidInput, match="already published as 00000003-rollout by checkpoint 'ck-1'"
    ):
        draft.publish(weight_version=1, loader_position=1)
    draft.discard()
    assert tree_digest(store.run_dir) == before
    other_kind = store.begin("trainer", "ck-1", seq=3)
    with pytest.raises(InvalidInput, match="refusing"):
        other_kind.publish(weight_version=1, loader_position=1)
    other_kind.discard()
    assert tree_digest(store.run_dir) == before


def test_republish_over_a_damaged_snapshot_is_refused_and_leaves_it(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    snap = publish(store, "ck-1", seq=3)
    (snap.path / "state.bin").write_bytes(b"ck-X")  # same size, other bytes
    before = tree_digest(store.run_dir)
    draft = store.begin("rollout", "ck-1", seq=3)
    with pytest.raises(SnapshotCorrupt, match="already published and does not verify"):
        draft.publish(weight_version=1, loader_position=1)
    draft.discard()
    assert tree_digest(store.run_dir) == before


def test_a_seq_older_than_the_newest_is_refused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    publish(store, "ck-5", seq=5)
    draft = store.begin("rollout", "ck-4", seq=4)
    with pytest.raises(InvalidInput, match="older than the newest published seq 5"):
        draft.publish(weight_version=0, loader_position=0)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_retention_keeps_the_newest_k(tmp_path: Path, keep: int) -> None:
    store = SnapshotStore(tmp_path, RUN, keep_latest_k=keep)
    for n in range(1, 6):
        publish(store, f"ck-{n}")
    kept = [snapshot_dir_name(n, "rollout") for n in range(6 - keep, 6)]
    assert entries(store) == kept
    assert store.select().name == "00000005-rollout"
    # Only the snapshot retired by the last publish waits in trash; the next begin sweeps it.
    trash = [p.name for p in store.snapshots_dir.iterdir() if is_retired(p.name)]
    assert [name.rsplit("-", 1)[0] for name in trash] == [
        ".trash-" + snapshot_dir_name(5 - keep, "rollout")
    ]
    store.begin(SnapshotKind.ROLLOUT, "ck-6").discard()
    assert sorted(p.name for p in store.snapshots_dir.iterdir()) == kept


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_keep_latest_k_must_be_a_positive_integer(tmp_path: Path, keep: object) -> None:
    with pytest.raises(InvalidInput, match="keep_latest_k"):
        SnapshotStore(tmp_path, RUN, keep_latest_k=keep)  # type: ignore[arg-type]


def test_retention_does_not_count_snapshots_whose_manifest_is_damaged(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN, keep_latest_k=2)
    publish(store, "ck-1")
    damaged = publish(store, "ck-2")
    (damaged.path / MANIFEST_NAME).write_bytes(b"{")
    publish(store, "ck-3")
    # Two readable snapshots are kept (3 and 1); the damaged one is left for an operator.
    assert entries(store) == ["00000001-rollout", "00000002-rollout", "00000003-rollout"]
    # Once two readable snapshots are newer, the damaged one is simply old: retention removes it.
    publish(store, "ck-4")
    assert entries(store) == ["00000003-rollout", "00000004-rollout"]


def test_begin_sweeps_crashed_drafts_and_trash_but_not_live_drafts(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    published = publish(store, "ck-1")
    live = store.begin("rollout", "ck-live", seq=9)
    live.write_bytes("a.bin", b"live")
    crashed = store.snapshots_dir / ".tmp-00000002-rollout-deadbeef"
    (crashed / "sub").mkdir(parents=True)
    (crashed / "sub" / "x.bin").write_bytes(b"x")
    trash = store.snapshots_dir / ".trash-00000000-rollout-cafe"
    trash.mkdir()
    (trash / "y.bin").write_bytes(b"y")

    other = store.begin("rollout", "ck-other", seq=10)
    assert not crashed.exists() and not trash.exists()
    assert live.path.is_dir() and (live.path / "a.bin").read_bytes() == b"live"
    assert published.path.is_dir()
    other.discard()
    assert live.publish(weight_version=0, loader_position=0).name == "00000009-rollout"


def test_a_dropped_draft_is_swept_like_a_crashed_one(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    dropped = store.begin("rollout", "ck-1").path
    # The draft object is gone (as if its process died): its lock is released.
    store.begin("rollout", "ck-2").discard()
    assert not dropped.exists()


def test_discard_removes_the_draft_and_later_calls_are_refused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    draft = store.begin("rollout", "ck-1")
    draft.write_bytes("a.bin", b"a")
    draft.discard()
    draft.discard()  # idempotent
    assert entries(store) == []
    with pytest.raises(InvalidInput, match="discarded"):
        draft.write_bytes("b.bin", b"b")
    with pytest.raises(InvalidInput, match="discarded"):
        draft.publish(weight_version=0, loader_position=0)


def capture_then_fail(store: SnapshotStore) -> None:
    """A capture that writes a file into its draft, then fails inside the draft's block."""
    with store.begin("rollout", "ck-1") as draft:
        draft.write_bytes("a.bin", b"a")
        raise RuntimeError("capture failed")


def test_context_manager_discards_on_error_and_keeps_published(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    with pytest.raises(RuntimeError, match="capture failed"):
        capture_then_fail(store)
    assert entries(store) == []
    with store.begin("rollout", "ck-2") as draft:
        draft.write_bytes("a.bin", b"a")
        snap = draft.publish(weight_version=0, loader_position=0)
    assert entries(store) == [snap.name]
    with pytest.raises(InvalidInput, match="published"):
        draft.write_bytes("b.bin", b"b")


@pytest.mark.parametrize(
    ("run_id", "kind", "checkpoint_id", "seq"),
    [
        ("bad/run", "rollout", "ck", None),
        ("", "rollout", "ck", None),
        ("run", "weights", "ck", None),
        ("run", "rollout", "", None),
        ("run", "rollout", "ck\n", None),
        ("run", "rollout", "ck", -1),
        ("run", "rollout", "ck", True),
    ],
)
def test_begin_validates_its_arguments(
    tmp_path: Path, run_id: str, kind: str, checkpoint_id: str, seq: int | None
) -> None:
    with pytest.raises(InvalidInput):
        SnapshotStore(tmp_path, run_id).begin(kind, checkpoint_id, seq)
    assert list(tmp_path.iterdir()) in ([], [tmp_path / "run"])


class Fault(Exception):
    pass


def test_a_failure_before_the_rename_leaves_the_draft_retryable(tmp_path: Path) -> None:
    armed = {"before_rename"}

    def fault(point: str) -> None:
        if point in armed:
            armed.discard(point)
            raise Fault(point)

    store = SnapshotStore(tmp_path, RUN, fault_hook=fault)
    draft = store.begin("rollout", "ck-1")
    draft.write_bytes("a.bin", b"a")
    with pytest.raises(Fault):
        draft.publish(weight_version=0, loader_position=0)
    assert not (draft.path / MANIFEST_NAME).exists()
    with pytest.raises(NoValidSnapshot):
        store.select()  # invisible
    assert draft.publish(weight_version=0, loader_position=0).name == "00000001-rollout"


CRASHING_PUBLISH = """
import os, sys
from pathlib import Path
from rollsafe.snapshot import SnapshotStore

root, point = Path(sys.argv[1]), sys.argv[2]

def crash(at: str) -> None:
    if at == point:
        os._exit(17)  # die on the spot: no cleanup, no finally, locks released by the kernel

store = SnapshotStore(root, "run-1", keep_latest_k=1, fault_hook=crash)
draft = store.begin("rollout", "ck-3", seq=3)
draft.write_bytes("state.bin", b"three")
draft.publish(weight_version=3, loader_position=30)
"""


def crash_publishing_seq_3(root: Path, point: str) -> None:
    repo = Path(rollsafe.snapshot.__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run(
        [sys.executable, "-c", CRASHING_PUBLISH, str(root), point], env=env, check=False
    )
    assert done.returncode == 17


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_a_crash_at_any_publish_step_is_all_or_nothing(tmp_path: Path, point: str) -> None:
    store = SnapshotStore(tmp_path, RUN, keep_latest_k=1)
    publish(store, "ck-2", seq=2)
    crash_publishing_seq_3(tmp_path, point)
    before = tree_digest(tmp_path)

    reader = store.select()
    committed = point in ("before_latest", "before_retention")
    assert reader.name == ("00000003-rollout" if committed else "00000002-rollout")
    if committed:
        assert reader.read_bytes("state.bin") == b"three"
    else:
        assert any(name.startswith(".tmp-00000003") for name in reader.skipped)
    if point == "before_latest":
        assert reader.latest_problem is not None
        assert "LATEST names 00000002-rollout" in reader.latest_problem
    else:
        assert reader.latest_problem is None
    assert tree_digest(tmp_path) == before  # select changed nothing

    # The activity's retry finishes the job, whichever step the crash interrupted.
    retried = publish(store, "ck-3", seq=3, files={"state.bin": b"three"})
    assert retried.reused == committed
    assert entries(store) == ["00000003-rollout"]
    final = store.select()
    assert final.latest_problem is None and final.skipped == {}
