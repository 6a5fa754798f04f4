"""MemoryDataPlane: copy rules, exact reads, and a verified, exact export/import round trip."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rollsafe.dataplane import columnar
from rollsafe.dataplane.memory import MemoryDataPlane
from rollsafe.dataplane.protocol import DataPlane, DataPlaneManifest, ExportedFile, row_digest
from rollsafe.errors import DataPlaneKeyMissing, InvalidInput, SchemaMismatch, SnapshotCorrupt
from rollsafe.snapshot.tensorfile import HashingWriter, read_tensors, write_tensors

# -- helpers -------------------------------------------------------------------------------------


def mixed_rows() -> dict[str, dict[str, np.ndarray]]:
    """Rows that differ in field set, dtype, ndim and shape, with awkward keys and values."""
    rng = np.random.default_rng(7)
    return {
        "plain": {
            "tokens": rng.integers(0, 50_000, 17, dtype=np.int64),
            "logp": rng.standard_normal(17).astype(np.float32),
            "done": np.array(True),
        },
        "a/b/c": {"tokens": np.arange(5, dtype=np.int32), "mask": np.array([True, False, True])},
        "ключ-🙂": {
            "tokens": np.zeros((2, 3), dtype=np.int32),
            "half": np.array([1.5, -0.0], np.float16),
        },
        "empty-arrays": {"tokens": np.zeros(0, np.int64), "grid": np.zeros((3, 0), np.float64)},
        "scalars": {"reward": np.array(0.25, np.float64), "step": np.array(-3, np.int64)},
        "no-fields": {},
        "nan": {"logp": np.array([np.nan, np.inf, -np.inf], np.float32)},
        "wide": {"u": np.array([0, 255], np.uint8), "f/ield \u00e9": np.array([1, 2], np.uint64)},
    }


def assert_same_rows(
    got: dict[str, dict[str, np.ndarray]], want: dict[str, dict[str, np.ndarray]]
) -> None:
    assert sorted(got) == sorted(want)
    for key, row in want.items():
        assert sorted(got[key]) == sorted(row), key
        for field, array in row.items():
            out = got[key][field]
            assert out.dtype == array.dtype and out.shape == array.shape, (key, field)
            assert np.array_equal(out, array, equal_nan=array.dtype.kind == "f"), (key, field)
            assert out.tobytes() == array.tobytes(), (key, field)
        assert row_digest(got[key]) == row_digest(row), key


def loaded(
    rows: dict[str, dict[str, np.ndarray]], **partitions: dict[str, dict[str, np.ndarray]]
) -> MemoryDataPlane:
    plane = MemoryDataPlane()
    plane.put("rollouts", rows)
    for name, more in partitions.items():
        plane.put(name, more)
    return plane


def rewrite(
    directory: Path, manifest: DataPlaneManifest, path: str, data: bytes
) -> DataPlaneManifest:
    """Replace one exported file and re-sign it in the manifest: only the decoder can object."""
    (directory / path).write_bytes(data)
    files = [
        ExportedFile(path=f.path, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
        if f.path == path
        else f
        for f in manifest.files
    ]
    return manifest.model_copy(update={"files": files})


def retensor(
    directory: Path, path: str, change: Callable[[dict[str, np.ndarray]], object]
) -> bytes:
    tensors, metadata = read_tensors((directory / path).read_bytes(), path)
    tensors = {name: np.array(array) for name, array in tensors.items()}
    change(tensors)
    out_path = directory / "retensor.tmp"
    with open(out_path, "wb") as handle:
        write_tensors(HashingWriter(handle), tensors, metadata)
    data = out_path.read_bytes()
    out_path.unlink()
    return data


Exported = tuple[Path, DataPlaneManifest]  # the export directory and its manifest


@pytest.fixture
def exported(tmp_path: Path) -> Exported:
    plane = loaded(mixed_rows(), prefixes={"p1": {"ids": np.arange(4, dtype=np.int32)}})
    directory = tmp_path / "export"
    return directory, plane.export(directory)


# -- basic operations -----------------------------------------------------------------------------


def test_implements_the_protocol() -> None:
    plane = MemoryDataPlane()
    assert isinstance(plane, DataPlane)
    assert plane.name == "memory"


def test_put_copies_and_get_returns_read_only_views() -> None:
    tokens = np.arange(6, dtype=np.int32)
    strided = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]  # not contiguous
    plane = MemoryDataPlane()
    plane.put("p", {"k": {"tokens": tokens, "strided": strided}})
    tokens[:] = -1
    strided[:] = -1
    row = plane.get("p", ["k"])["k"]
    assert row["tokens"].tolist() == [0, 1, 2, 3, 4, 5]
    assert row["strided"].tolist() == [[0, 2], [4, 6], [8, 10]]
    with pytest.raises(ValueError, match="assignment destination is read-only"):
        row["tokens"][0] = 99
    with pytest.raises(ValueError, match="cannot set WRITEABLE flag to True"):
        row["tokens"].setflags(write=True)
    row["extra"] = np.zeros(1)  # the returned dict is the caller's own
    assert sorted(plane.get("p", ["k"])["k"]) == ["strided", "tokens"]
    assert plane.get("p", ["k"])["k"]["tokens"].tolist() == [0, 1, 2, 3, 4, 5]


def test_reput_replaces_the_whole_row() -> None:
    plane = MemoryDataPlane()
    plane.put("p", {"k": {"a": np.ones(2), "b": np.ones(1)}})
    plane.put("p", {"k": {"c": np.zeros(3, np.int8)}})
    row = plane.get("p", ["k"])["k"]
    assert list(row) == ["c"] and row["c"].dtype == np.int8


def test_get_returns_exactly_the_requested_keys_and_dedups() -> None:
    plane = MemoryDataPlane()
    plane.put("p", {k: {"x": np.array(i)} for i, k in enumerate("abcd")})
    got = plane.get("p", ["c", "a", "c"])
    assert sorted(got) == ["a", "c"]
    assert int(got["c"]["x"]) == 2
    assert plane.get("p", []) == {} and plane.get("unknown", []) == {}


def test_get_names_every_missing_key_and_never_reads_short() -> None:
    plane = MemoryDataPlane()
    plane.put("p", {"a": {"x": np.zeros(1)}})
    with pytest.raises(DataPlaneKeyMissing) as info:
        plane.get("p", ["a", "zz", "b"])
    assert info.value.partition == "p" and info.value.missing == ["b", "zz"]
    assert "'p'" in str(info.value) and "b, zz" in str(info.value)
    with pytest.raises(DataPlaneKeyMissing) as info:
        plane.get("nowhere", ["a"])
    assert info.value.partition == "nowhere" and info.value.missing == ["a"]


def test_list_delete_clear_partitions() -> None:
    plane = MemoryDataPlane()
    assert plane.list("p") == [] and plane.partitions() == []
    plane.put("p", {k: {"x": np.zeros(1)} for k in ["b", "a", "c"]})
    plane.put("q", {"z": {}})
    plane.put("empty", {})
    assert plane.list("p") == ["a", "b", "c"]
    assert plane.partitions() == ["p", "q"]
    with pytest.raises(DataPlaneKeyMissing) as info:
        plane.delete("p", ["a", "nope"])
    assert info.value.missing == ["nope"]
    assert plane.list("p") == ["a", "b", "c"]  # nothing deleted
    plane.delete("p", ["a", "a"])
    assert plane.list("p") == ["b", "c"]
    plane.delete("p", ["b", "c"])
    assert plane.partitions() == ["q"]  # an emptied partition is gone
    plane.put("p", {"a": {}})
    plane.clear("q")
    plane.clear("never-existed")
    assert plane.partitions() == ["p"]
    plane.clear()
    assert plane.partitions() == [] and plane.list("p") == []


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a b", "x" * 65, "ü", "a\\b", 5])
def test_invalid_partition_names_are_refused(name: Any) -> None:  # not all str: on purpose
    plane = MemoryDataPlane()
    for call in (
        lambda: plane.put(name, {"k": {}}),
        lambda: plane.get(name, ["k"]),
        lambda: plane.list(name),
        lambda: plane.delete(name, []),
        lambda: plane.clear(name),
    ):
        with pytest.raises(InvalidInput):
            call()


def test_valid_partition_names_are_accepted() -> None:
    plane = MemoryDataPlane()
    for name in ["x" * 64, "a.b-c_D9", "...", "-"]:
        plane.put(name, {"k": {}})
    assert len(plane.partitions()) == 4


@pytest.mark.parametrize(
    "row",
    [
        {"x": [1, 2]},  # not an array
        {"x": np.float32(1.0)},  # a numpy scalar, not an array
        {"x": np.array(["a"])},
        {"x": np.array([object()])},
        {"x": np.array([1 + 2j])},
        {"x": np.arange(3, dtype=">i4")},  # safetensors would flip it to little-endian
        {1: np.zeros(1)},
        "not a row",
    ],
)
def test_bad_rows_are_refused_and_the_batch_stores_nothing(row: Any) -> None:  # not rows
    plane = MemoryDataPlane()
    with pytest.raises(InvalidInput):
        plane.put("p", {"good": {"x": np.zeros(1)}, "bad": row})
    assert plane.partitions() == []


@pytest.mark.parametrize("keys", ["abc", [""], [3]])
def test_bad_keys_are_refused(keys: Any) -> None:  # not all lists of str: on purpose
    plane = MemoryDataPlane()
    plane.put("p", {"a": {}})
    with pytest.raises(InvalidInput):
        plane.get("p", keys)
    with pytest.raises(InvalidInput):
        plane.delete("p", keys)
    if not isinstance(keys, str):
        with pytest.raises(InvalidInput):
            plane.put("p", {key: {} for key in keys})
    assert plane.list("p") == ["a"]


def test_row_digest_tells_a_scalar_from_a_one_element_vector() -> None:
    assert row_digest({"x": np.array(3)}) != row_digest({"x": np.array([3])})
    assert row_digest({"x": np.array(3)}) == row_digest({"x": np.array(3)})


# -- export and import ---------------------------------------------------------------------------


def test_round_trip_is_exact(tmp_path: Path) -> None:
    rows = mixed_rows()
    prefixes = {"p1": {"ids": np.arange(4, dtype=np.int32)}, "p/2": {"ids": np.array(9)}}
    plane = loaded(rows, prefixes=prefixes)
    manifest = plane.export(tmp_path / "nested" / "export")
    assert manifest.backend == "memory" and manifest.format_version == 1
    assert manifest.partitions == {"prefixes": 2, "rollouts": len(rows)}

    other = MemoryDataPlane()
    other.import_(tmp_path / "nested" / "export", manifest)
    assert other.partitions() == ["prefixes", "rollouts"]
    assert_same_rows(other.get("rollouts", other.list("rollouts")), rows)
    assert_same_rows(other.get("prefixes", other.list("prefixes")), prefixes)
    # imported rows follow the same copy rule as put ones
    with pytest.raises(ValueError, match="assignment destination is read-only"):
        other.get("rollouts", ["plain"])["plain"]["tokens"][0] = 1


def test_manifest_lists_every_file_with_its_hash(exported: Exported) -> None:
    directory, manifest = exported
    on_disk = sorted(
        p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()
    )
    assert sorted(f.path for f in manifest.files) == on_disk
    for entry in manifest.files:
        data = (directory / entry.path).read_bytes()
        assert entry.bytes == len(data)
        assert entry.sha256 == hashlib.sha256(data).hexdigest()
    assert {path.split("/")[0] for path in on_disk} == {"prefixes", "rollouts"}
    # no pickle anywhere: only JSON and safetensors
    assert all(p.endswith((".json", ".safetensors")) for p in on_disk)


def test_export_is_columnar_not_one_tensor_per_row(tmp_path: Path) -> None:
    plane = MemoryDataPlane()
    rows = {
        f"r{i}": {"tokens": np.full(10, i, np.int32), "r": np.array(i * 0.5)} for i in range(500)
    }
    plane.put("p", rows)
    manifest = plane.export(tmp_path / "x")
    (shard,) = [f.path for f in manifest.files if f.path.endswith(".safetensors")]
    tensors, _ = read_tensors((tmp_path / "x" / shard).read_bytes(), shard)
    assert len(tensors) == 8  # two (field, dtype, ndim) groups, four tensors each
    other = MemoryDataPlane()
    other.import_(tmp_path / "x", manifest)
    assert_same_rows(other.get("p", rows), rows)


def test_export_is_deterministic(tmp_path: Path) -> None:
    plane = loaded(mixed_rows())
    first, second = plane.export(tmp_path / "a"), plane.export(tmp_path / "b")
    assert first == second


def test_shards_split_large_partitions(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    rows = {
        f"k{i:03d}": {"a": rng.integers(0, 9, 40, dtype=np.int64), "b": rng.random(i % 5)}
        for i in range(200)
    }
    rows["huge"] = {"a": np.arange(2_000, dtype=np.int64)}  # larger than a shard on its own
    plane = MemoryDataPlane(shard_bytes=4096)
    plane.put("p", rows)
    manifest = plane.export(tmp_path / "x")
    shards = [f for f in manifest.files if f.path.endswith(".safetensors")]
    assert len(shards) > 10
    assert sum(f.bytes > 4096 * 2 for f in shards) == 1  # only the huge row's shard
    other = MemoryDataPlane()
    other.import_(tmp_path / "x", manifest)
    assert_same_rows(other.get("p", rows), rows)


def test_empty_plane_round_trips(tmp_path: Path) -> None:
    manifest = MemoryDataPlane().export(tmp_path / "x")
    assert manifest.files == [] and manifest.partitions == {}
    other = MemoryDataPlane()
    other.import_(tmp_path / "x", manifest)
    assert other.partitions() == []


def test_export_refuses_a_non_empty_target(tmp_path: Path) -> None:
    plane = loaded(mixed_rows())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(InvalidInput):
        plane.export(tmp_path / "full")
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidInput):
        plane.export(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    plane.export(tmp_path / "empty")


def test_export_sees_rows_as_they_were(tmp_path: Path) -> None:
    plane = loaded({"a": {"x": np.zeros(2)}})
    manifest = plane.export(tmp_path / "x")
    plane.put("rollouts", {"a": {"x": np.ones(2)}, "b": {}})
    other = MemoryDataPlane()
    other.import_(tmp_path / "x", manifest)
    assert other.list("rollouts") == ["a"]
    assert other.get("rollouts", ["a"])["a"]["x"].tolist() == [0, 0]


def test_import_only_into_an_empty_plane(exported: Exported) -> None:
    directory, manifest = exported
    plane = MemoryDataPlane()
    plane.put("mine", {"k": {"x": np.zeros(1)}})
    with pytest.raises(InvalidInput):
        plane.import_(directory, manifest)
    assert plane.partitions() == ["mine"] and plane.list("mine") == ["k"]


def test_put_during_import_wins_and_the_import_fails(
    exported: Exported, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, manifest = exported
    plane = MemoryDataPlane()
    real = columnar.read_export

    def put_meanwhile(directory: Path, manifest: DataPlaneManifest) -> dict[str, columnar.Rows]:
        plane.put("late", {"k": {}})
        return real(directory, manifest)

    monkeypatch.setattr(columnar, "read_export", put_meanwhile)
    with pytest.raises(InvalidInput):
        plane.import_(directory, manifest)
    assert plane.partitions() == ["late"]


# -- corruption: every case must raise and leave the plane empty ----------------------------------


def refused(directory: Path, manifest: DataPlaneManifest, error: type[Exception]) -> str:
    plane = MemoryDataPlane()
    with pytest.raises(error) as info:
        plane.import_(directory, manifest)
    assert plane.partitions() == []
    return str(info.value)


@pytest.mark.parametrize("which", ["index", "shard"])
def test_flipped_byte_is_refused(exported: Exported, which: str) -> None:
    directory, manifest = exported
    path = next(f.path for f in manifest.files if (which == "index") == f.path.endswith(".json"))
    data = bytearray((directory / path).read_bytes())
    data[len(data) // 2] ^= 0x01
    (directory / path).write_bytes(bytes(data))
    assert path in refused(directory, manifest, SnapshotCorrupt)


def test_flipped_array_byte_is_caught_by_the_hash(exported: Exported) -> None:
    # The last byte of a shard is array data: it decodes fine, so only the sha256 can object.
    directory, manifest = exported
    for entry in manifest.files:
        if entry.path.endswith(".safetensors"):
            data = bytearray((directory / entry.path).read_bytes())
            data[-1] ^= 0x80
            (directory / entry.path).write_bytes(bytes(data))
            message = refused(directory, manifest, SnapshotCorrupt)
            assert entry.path in message and "sha256" in message
            data[-1] ^= 0x80
            (directory / entry.path).write_bytes(bytes(data))


def test_truncated_file_is_refused(exported: Exported) -> None:
    directory, manifest = exported
    path = next(f.path for f in manifest.files if f.path.endswith(".safetensors"))
    data = (directory / path).read_bytes()
    (directory / path).write_bytes(data[:-1])
    assert path in refused(directory, manifest, SnapshotCorrupt)


def test_deleted_file_is_refused(exported: Exported) -> None:
    directory, manifest = exported
    path = manifest.files[0].path
    (directory / path).unlink()
    assert path in refused(directory, manifest, SnapshotCorrupt)


@pytest.mark.parametrize("extra", ["stray.bin", "rollouts/shard-99999.safetensors", "new/x.json"])
def test_unlisted_file_is_refused(exported: Exported, extra: str) -> None:
    directory, manifest = exported
    (directory / extra).parent.mkdir(parents=True, exist_ok=True)
    (directory / extra).write_bytes(b"")
    assert extra in refused(directory, manifest, SnapshotCorrupt)


def test_symlink_is_refused(exported: Exported) -> None:
    directory, manifest = exported
    (directory / "link").symlink_to(directory / manifest.files[0].path)
    refused(directory, manifest, SnapshotCorrupt)


def test_listed_file_replaced_by_a_symlink_is_refused(exported: Exported, tmp_path: Path) -> None:
    directory, manifest = exported
    path = directory / manifest.files[0].path
    outside = tmp_path / "outside"
    outside.write_bytes(path.read_bytes())  # same bytes, same hash: only the link is wrong
    path.unlink()
    path.symlink_to(outside)
    assert "not a regular file" in refused(directory, manifest, SnapshotCorrupt)


def test_tampered_row_count_is_refused(exported: Exported) -> None:
    directory, manifest = exported
    counts = {**manifest.partitions, "rollouts": manifest.partitions["rollouts"] + 1}
    message = refused(
        directory, manifest.model_copy(update={"partitions": counts}), SnapshotCorrupt
    )
    assert "rollouts/index.json" in message


def test_partition_missing_from_the_manifest_is_refused(exported: Exported) -> None:
    directory, manifest = exported
    counts = {"rollouts": manifest.partitions["rollouts"]}
    refused(directory, manifest.model_copy(update={"partitions": counts}), SnapshotCorrupt)


@pytest.mark.parametrize("path", ["../escape", "/abs", "a//b", "./a", "a\\b"])
def test_unsafe_manifest_path_is_refused(exported: Exported, path: str) -> None:
    directory, manifest = exported
    files = [*manifest.files, ExportedFile(path=path, sha256="0" * 64, bytes=0)]
    refused(directory, manifest.model_copy(update={"files": files}), SnapshotCorrupt)


@pytest.mark.parametrize("update", [{"backend": "somedb"}, {"format_version": 2}])
def test_foreign_manifest_is_a_schema_mismatch(
    exported: Exported, update: dict[str, str | int]
) -> None:
    directory, manifest = exported
    refused(directory, manifest.model_copy(update=update), SchemaMismatch)


def test_missing_directory_is_refused(tmp_path: Path, exported: Exported) -> None:
    _, manifest = exported
    refused(tmp_path / "nowhere", manifest, SnapshotCorrupt)


def index_with(directory: Path, change: Callable[[dict[str, Any]], object]) -> bytes:
    index = json.loads((directory / "rollouts/index.json").read_bytes())
    change(index)
    return json.dumps(index).encode()


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda ix: ix.update(format_version=2), SnapshotCorrupt),
        (lambda ix: ix.update(surprise=1), SnapshotCorrupt),
        (lambda ix: ix.update(partition="other"), SnapshotCorrupt),
        (lambda ix: ix["keys"].__setitem__(1, ix["keys"][0]), SnapshotCorrupt),
        (lambda ix: ix["chunks"][0].update(rows=ix["chunks"][0]["rows"] + 1), SnapshotCorrupt),
        (lambda ix: ix["chunks"][0].update(dtype="F64"), SnapshotCorrupt),
        (lambda ix: ix["chunks"][0].update(ndim="1"), SnapshotCorrupt),
        (lambda ix: ix["chunks"][0].update(shard="shard-00001.safetensors"), SnapshotCorrupt),
        (lambda ix: ix["chunks"].append(ix["chunks"][0]), SnapshotCorrupt),
        (lambda ix: ix["chunks"][1].update(tensor=ix["chunks"][0]["tensor"]), SnapshotCorrupt),
        (lambda ix: ix["chunks"][1].update(tensor="c99"), SnapshotCorrupt),
    ],
)
def test_inconsistent_index_is_refused(
    exported: Exported, change: Callable[[dict[str, Any]], object], error: type[Exception]
) -> None:
    directory, manifest = exported
    manifest = rewrite(directory, manifest, "rollouts/index.json", index_with(directory, change))
    assert "rollouts/" in refused(directory, manifest, error)


def test_unreadable_index_is_refused(exported: Exported) -> None:
    directory, manifest = exported
    manifest = rewrite(directory, manifest, "rollouts/index.json", b"\xff{not json")
    assert "rollouts/index.json" in refused(directory, manifest, SnapshotCorrupt)


def _set(
    part: str, value: Callable[[np.ndarray], np.ndarray]
) -> Callable[[dict[str, np.ndarray], str], None]:
    def change(tensors: dict[str, np.ndarray], chunk: str) -> None:
        tensors[f"{chunk}.{part}"] = value(tensors[f"{chunk}.{part}"])

    return change


@pytest.mark.parametrize(
    "change",
    [
        _set("offsets", lambda a: a + 1),
        _set("offsets", lambda a: a[::-1].copy()),
        _set("rows", lambda a: a + 1000),
        _set("rows", lambda a: np.full_like(a, a[0])),  # one row's field twice
        _set("rows", lambda a: a.astype(np.int32)),
        _set("shapes", lambda a: a[::-1].copy()),  # sizes no longer match the offsets
        _set("shapes", lambda a: -a),
        _set("data", lambda a: a[:-1]),
        _set("data", lambda a: a.astype(np.int32)),
        lambda t, chunk: t.pop(f"{chunk}.rows"),
        lambda t, chunk: t.update(extra=np.zeros(1)),
    ],
)
def test_inconsistent_shard_is_refused(
    exported: Exported, change: Callable[[dict[str, np.ndarray], str], object]
) -> None:
    directory, manifest = exported
    index = json.loads((directory / "rollouts/index.json").read_bytes())
    # int64 "tokens" holds two rows of 17 and 0 elements: every change above is visible there
    (chunk,) = [c for c in index["chunks"] if c["field"] == "tokens" and c["dtype"] == "I64"]
    assert chunk["rows"] == 2
    shard = f"rollouts/{chunk['shard']}"
    data = retensor(directory, shard, lambda tensors: change(tensors, chunk["tensor"]))
    manifest = rewrite(directory, manifest, shard, data)
    assert shard in refused(directory, manifest, SnapshotCorrupt)


# -- property: any exportable rows round-trip exactly ---------------------------------------------

dtypes = st.sampled_from(["?", "u1", "i1", "i2", "i4", "i8", "u2", "u4", "u8", "f2", "f4", "f8"])
arrays = dtypes.flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0))
)
rows_strategy = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.dictionaries(st.text(max_size=5), arrays, max_size=3),
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(rows=rows_strategy, shard_bytes=st.sampled_from([64, 1 << 20]))
def test_any_rows_round_trip(rows: dict[str, dict[str, np.ndarray]], shard_bytes: int) -> None:
    plane = MemoryDataPlane(shard_bytes=shard_bytes)
    plane.put("p", rows)
    with tempfile.TemporaryDirectory() as scratch:
        manifest = plane.export(Path(scratch) / "x")
        other = MemoryDataPlane()
        other.import_(Path(scratch) / "x", manifest)
    assert_same_rows(other.get("p", rows), rows)


def test_count_follows_puts_and_deletes() -> None:
    plane = MemoryDataPlane()
    assert plane.count("p") == 0
    plane.put("p", {"a": {"x": np.arange(2)}, "b": {"x": np.arange(3)}})
    plane.delete("p", ["a"])
    assert plane.count("p") == 1 == len(plane.list("p"))
