"""Select: newest snapshot that verifies, fail closed with reasons, never touching the disk."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from rollsafe.errors import (
    ContentMismatch,
    InvalidInput,
    NoValidSnapshot,
    SchemaMismatch,
    SnapshotCorrupt,
)
from rollsafe.snapshot import (
    MANIFEST_NAME,
    EntryState,
    SnapshotManifest,
    SnapshotStore,
    verify_snapshot,
    with_digest,
)

RUN = "run-1"
NEWEST, OLDER = "00000002-rollout", "00000001-rollout"


class Loader(BaseModel):
    model_config = ConfigDict(extra="forbid")

    position: int


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under ``root``: relpath -> sha256 of its bytes, 'dir', or a link target."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = f"link:{path.readlink()}"
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def make_store(root: Path, count: int = 2, keep: int = 5) -> SnapshotStore:
    store = SnapshotStore(root, RUN, keep_latest_k=keep)
    for n in range(1, count + 1):
        draft = store.begin("rollout", f"ck-{n}")
        draft.write_bytes("ledger.bin", b"ledger-%d " % n * 20)
        draft.write_bytes("dataplane/rows.bin", bytes(range(256)) * n)
        draft.write_json("loader.json", Loader(position=10 * n))
        draft.publish(weight_version=n, loader_position=10 * n, anchor_step=n)
    return store


def edit_manifest(
    path: Path, change: Callable[[dict[str, object]], object], *, reseal: bool = True
) -> None:
    """``change`` the manifest's fields; ``reseal``: and its digest with them, as a writer that
    meant it would (else the edit is refused as such, before any other check sees it)."""
    data = json.loads((path / MANIFEST_NAME).read_bytes())
    change(data)
    if reseal and "digest" in data:
        data = with_digest(data)
    (path / MANIFEST_NAME).write_text(json.dumps(data))


def truncate(path: Path) -> None:
    target = path / "ledger.bin"
    target.write_bytes(target.read_bytes()[:-5])


def flip_byte(path: Path) -> None:
    target = path / "dataplane" / "rows.bin"
    data = bytearray(target.read_bytes())
    data[100] ^= 0x01
    target.write_bytes(bytes(data))


def schema_v3(data: dict[str, object]) -> None:
    data["schema_version"] = 3
    data["shards"] = 4


def rename_to_seq_5(path: Path) -> None:
    path.rename(path.with_name("00000005-rollout"))


def symlink_inside(path: Path) -> None:
    (path / "link.bin").symlink_to(path / "ledger.bin")


CORRUPTIONS: dict[str, tuple[Callable[[Path], object], str]] = {
    "truncated file": (truncate, "ledger.bin: 175 bytes, manifest says 180"),
    "flipped byte": (flip_byte, "dataplane/rows.bin: sha256 does not match"),
    "a field edited, its digest not": (
        lambda p: edit_manifest(p, lambda d: d.update(loader_position=0), reseal=False),
        "its digest does not match its fields",
    ),
    "unknown manifest field": (
        lambda p: edit_manifest(p, lambda d: d.update(surprise=1)),
        r"unknown field(s): surprise",
    ),
    "unknown schema version": (
        lambda p: edit_manifest(p, schema_v3),
        "unknown schema_version 3",
    ),
    "missing field": (
        lambda p: edit_manifest(p, lambda d: d.pop("loader_position")),
        "missing field(s): loader_position",
    ),
    "wrong run id": (
        lambda p: edit_manifest(p, lambda d: d.update(run_id="run-9")),
        "belongs to run 'run-9'",
    ),
    "manifest disagrees with dir name": (
        lambda p: edit_manifest(p, lambda d: d.update(seq=3)),
        "manifest says seq 3",
    ),
    "missing file": (lambda p: (p / "loader.json").unlink(), "missing file(s): loader.json"),
    "extra unlisted file": (
        lambda p: (p / "dataplane" / "notes.txt").write_bytes(b"hi"),
        "unlisted file(s): dataplane/notes.txt",
    ),
    "missing manifest": (lambda p: (p / MANIFEST_NAME).unlink(), "no manifest.json"),
    "unparseable manifest": (
        lambda p: (p / MANIFEST_NAME).write_bytes(b'{"schema_version": 1,'),
        "not valid JSON",
    ),
    "symlink inside": (symlink_inside, "symlink or special file(s) not allowed: link.bin"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_a_damaged_newest_snapshot_is_skipped_with_its_reason(tmp_path: Path, case: str) -> None:
    store = make_store(tmp_path)
    damage, expected = CORRUPTIONS[case]
    damage(store.snapshots_dir / NEWEST)
    before = tree_digest(tmp_path)

    reader = store.select()
    assert reader.name == OLDER
    assert reader.manifest.checkpoint_id == "ck-1"
    assert len(reader.skipped) == 1
    (reason,) = reader.skipped.values()
    assert expected in reason
    assert reader.latest_problem == f"LATEST names {NEWEST}, but {OLDER} was selected"
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_verify_snapshot_names_the_directory_and_the_problem(tmp_path: Path, case: str) -> None:
    store = make_store(tmp_path, count=1)
    damage, expected = CORRUPTIONS[case]
    path = store.snapshots_dir / OLDER
    damage(path)
    path = next(p for p in store.snapshots_dir.iterdir())  # may have been renamed
    before = tree_digest(tmp_path)
    with pytest.raises((SnapshotCorrupt, SchemaMismatch)) as info:
        verify_snapshot(path, RUN)
    assert str(path) in str(info.value) and expected in str(info.value)
    assert tree_digest(tmp_path) == before


def test_schema_problems_raise_schema_mismatch(tmp_path: Path) -> None:
    store = make_store(tmp_path, count=1)
    edit_manifest(store.snapshots_dir / OLDER, schema_v3)
    with pytest.raises(SchemaMismatch, match="unknown schema_version 3"):
        verify_snapshot(store.snapshots_dir / OLDER, RUN)


def test_fail_closed_when_nothing_verifies(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    flip_byte(store.snapshots_dir / NEWEST)
    (store.snapshots_dir / OLDER / "loader.json").unlink()
    before = tree_digest(tmp_path)
    with pytest.raises(NoValidSnapshot) as info:
        store.select()
    assert set(info.value.reasons) == {NEWEST, OLDER}
    assert "sha256 does not match" in info.value.reasons[NEWEST]
    assert "missing file(s): loader.json" in info.value.reasons[OLDER]
    assert f"{OLDER}: " in str(info.value)  # the message names every candidate
    assert tree_digest(tmp_path) == before


def test_an_empty_store_has_no_valid_snapshot(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    with pytest.raises(NoValidSnapshot, match="no snapshot under"):
        store.select()
    assert list(tmp_path.iterdir()) == []  # select created nothing
    assert store.list() == []
    assert store.latest_pointer() is None


def test_another_runs_snapshots_are_refused(tmp_path: Path) -> None:
    make_store(tmp_path)
    shutil.copytree(tmp_path / RUN, tmp_path / "run-2")
    with pytest.raises(NoValidSnapshot) as info:
        SnapshotStore(tmp_path, "run-2").select()
    assert all("belongs to run 'run-1'" in why for why in info.value.reasons.values())


def test_latest_pointing_at_a_missing_dir_is_reported(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    pointer = json.loads(store.latest_path.read_bytes())
    pointer.update(snapshot="00000009-rollout", seq=9)
    store.latest_path.write_text(json.dumps(pointer))
    before = tree_digest(tmp_path)
    reader = store.select()
    assert reader.name == NEWEST
    assert reader.latest_problem == "LATEST names 00000009-rollout, which does not exist"
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"00000002-rollout\n", "not valid JSON"),
        (b"", "not valid JSON"),
        (b'{"pointer_version": 2}', "unknown pointer_version 2"),
        (None, "LATEST is missing"),
    ],
)
def test_unreadable_latest_is_reported_and_select_still_works(
    tmp_path: Path, content: bytes | None, problem: str
) -> None:
    store = make_store(tmp_path)
    if content is None:
        store.latest_path.unlink()
    else:
        store.latest_path.write_bytes(content)
    before = tree_digest(tmp_path)
    reader = store.select()
    assert reader.name == NEWEST
    assert reader.latest_problem is not None and problem in reader.latest_problem
    assert tree_digest(tmp_path) == before


def test_latest_parsing_errors_surface_from_latest_pointer(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    pointer = store.latest_pointer()
    assert pointer is not None and pointer.snapshot == NEWEST
    store.latest_path.write_bytes(b"garbage")
    with pytest.raises(SnapshotCorrupt, match="LATEST: not valid JSON"):
        store.latest_pointer()


def test_latest_with_a_stale_manifest_digest_is_reported(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    pointer = json.loads(store.latest_path.read_bytes())
    pointer["manifest_sha256"] = "0" * 64
    store.latest_path.write_text(json.dumps(pointer))
    assert store.select().latest_problem == (
        f"LATEST records a different manifest sha256 for {NEWEST}"
    )


def test_bad_latest_is_listed_when_nothing_verifies(tmp_path: Path) -> None:
    store = make_store(tmp_path, count=1)
    (store.snapshots_dir / OLDER / MANIFEST_NAME).unlink()
    store.latest_path.write_bytes(b"?")
    with pytest.raises(NoValidSnapshot) as info:
        store.select()
    assert set(info.value.reasons) == {OLDER, "LATEST"}


def test_a_draft_left_by_a_crash_is_ignored_then_swept(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    crashed = store.snapshots_dir / ".tmp-00000003-rollout-0123456789ab"
    crashed.mkdir()
    (crashed / "ledger.bin").write_bytes(b"half")
    (crashed / MANIFEST_NAME).write_bytes(b"{}")
    (store.snapshots_dir / "README").write_bytes(b"operator notes")
    before = tree_digest(tmp_path)

    reader = store.select()
    assert reader.name == NEWEST and reader.latest_problem is None
    assert "unpublished draft" in reader.skipped[crashed.name]
    assert "not a snapshot directory name" in reader.skipped["README"]
    assert tree_digest(tmp_path) == before

    store.begin("rollout", "ck-3").discard()
    assert not crashed.exists()
    assert (store.snapshots_dir / "README").exists()  # not ours to delete
    assert store.select().name == NEWEST


def test_accept_can_refuse_a_snapshot(tmp_path: Path) -> None:
    store = make_store(tmp_path)

    def anchored_at_1(manifest: SnapshotManifest) -> str | None:
        return None if manifest.anchor_step == 1 else f"anchor {manifest.anchor_step} != 1"

    reader = store.select(anchored_at_1)
    assert reader.name == OLDER
    assert reader.skipped == {NEWEST: "not accepted: anchor 2 != 1"}
    with pytest.raises(NoValidSnapshot, match="not accepted"):
        store.select(lambda manifest: "never")


def test_reader_reads_verified_files(tmp_path: Path) -> None:
    reader = make_store(tmp_path).select()
    assert reader.read_bytes("ledger.bin") == b"ledger-2 " * 20
    assert reader.read_json("loader.json", Loader) == Loader(position=20)
    assert reader.manifest.loader_position == 20


def test_reader_reverifies_each_file_it_reads(tmp_path: Path) -> None:
    reader = make_store(tmp_path).select()
    flip_byte(reader.path)
    with pytest.raises(SnapshotCorrupt, match=r"dataplane/rows\.bin: sha256 does not match"):
        reader.read_bytes("dataplane/rows.bin")
    truncate(reader.path)
    with pytest.raises(SnapshotCorrupt, match="175 bytes, manifest says 180"):
        reader.read_bytes("ledger.bin")
    (reader.path / "loader.json").unlink()
    before = tree_digest(tmp_path)
    with pytest.raises(SnapshotCorrupt, match="unreadable"):
        reader.read_bytes("loader.json")
    with pytest.raises(SnapshotCorrupt):
        reader.read_bytes("ledger.bin")
    assert tree_digest(tmp_path) == before  # a failed load repairs and deletes nothing


def test_reader_refuses_paths_outside_the_manifest(tmp_path: Path) -> None:
    reader = make_store(tmp_path).select()
    with pytest.raises(InvalidInput, match="not a file of snapshot"):
        reader.read_bytes("dataplane")
    with pytest.raises(InvalidInput, match="invalid snapshot path"):
        reader.read_bytes("../LATEST")
    with pytest.raises(InvalidInput):
        reader.read_bytes(MANIFEST_NAME)


def test_read_json_refuses_content_that_does_not_fit_the_model(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    draft = store.begin("rollout", "ck-1")
    draft.write_json("extra.json", {"position": 1, "cursor": 2})
    draft.write_json("wrong.json", {"position": "far"})
    reader = draft.publish(weight_version=0, loader_position=0).reader()
    with pytest.raises(SchemaMismatch, match=r"extra\.json: unknown field\(s\): cursor"):
        reader.read_json("extra.json", Loader)
    with pytest.raises(SnapshotCorrupt, match=r"wrong\.json: position"):
        reader.read_json("wrong.json", Loader)


def test_list_reports_every_entry_with_its_state(tmp_path: Path) -> None:
    store = make_store(tmp_path, count=3)
    flip_byte(store.snapshots_dir / "00000002-rollout")
    (store.snapshots_dir / ".tmp-00000004-rollout-aa").mkdir()
    (store.snapshots_dir / ".trash-00000000-rollout-bb").mkdir()
    before = tree_digest(tmp_path)

    listed = {entry.name: entry for entry in store.list()}
    assert {name: entry.state for name, entry in listed.items()} == {
        "00000003-rollout": EntryState.VALID,
        "00000002-rollout": EntryState.INVALID,
        OLDER: EntryState.VALID,
        ".tmp-00000004-rollout-aa": EntryState.TEMP,
        ".trash-00000000-rollout-bb": EntryState.TRASH,
    }
    assert listed["00000003-rollout"].manifest is not None
    assert "sha256 does not match" in (listed["00000002-rollout"].reason or "")
    assert [e.name for e in store.list()][:3] == ["00000003-rollout", "00000002-rollout", OLDER]
    unchecked = {e.state for e in store.list(verify=False) if e.seq is not None}
    assert unchecked == {EntryState.UNCHECKED}
    assert tree_digest(tmp_path) == before


def test_select_without_contents_leaves_each_file_to_the_read_that_loads_it(
    tmp_path: Path,
) -> None:
    """``contents=False`` (the restore's select): a file changed in place, same size, is
    chosen (no byte was hashed) and then refused by the read or by ``verify_unread``, with
    ContentMismatch naming it; the other files' reads still verify."""
    store = make_store(tmp_path)
    flip_byte(store.snapshots_dir / NEWEST)
    reader = store.select(contents=False)
    assert reader.name == NEWEST
    assert reader.unverified == {"ledger.bin", "dataplane/rows.bin", "loader.json"}
    assert reader.read_json("loader.json", Loader) == Loader(position=20)
    assert reader.unverified == {"ledger.bin", "dataplane/rows.bin"}
    with pytest.raises(ContentMismatch, match=rf"{NEWEST}/dataplane/rows\.bin: sha256"):
        reader.verify_unread()
    with pytest.raises(ContentMismatch, match="sha256 does not match"):
        reader.read_bytes("dataplane/rows.bin")
    # Another reader that checked a file against the manifest's digest takes it off the list.
    reader.checked_elsewhere({"ledger.bin": reader.manifest.files["ledger.bin"].sha256})
    assert reader.unverified == {"dataplane/rows.bin"}
    with pytest.raises(ContentMismatch, match="not the file the manifest lists"):
        reader.checked_elsewhere({"ledger.bin": "0" * 64})


def test_select_again_with_refused_names_goes_to_the_next_snapshot(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    why = f"{NEWEST}/dataplane/rows.bin: sha256 does not match the manifest"
    reader = store.select(contents=False, refused={NEWEST: why})
    assert reader.name == OLDER and reader.skipped == {NEWEST: why}
    reader.verify_unread()
    assert reader.unverified == set()
    assert store.select().unverified == set()  # a full select checked every file already
