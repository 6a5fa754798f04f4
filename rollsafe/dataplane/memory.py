"""The in-process data plane (DESIGN.md section 9): the embedded default, and the one tests use.

Every stored array is a private C-contiguous copy marked read-only, and ``get`` hands out
read-only views of it: callers cannot change what the plane holds, reads copy nothing, and
``export`` gets a consistent picture by copying the dicts alone (arrays are replaced, never
changed in place). An export is columnar, so its cost follows the bytes, not the row count::

    <partition>/index.json               keys (row number i is keys[i]) and the chunk table
    <partition>/shard-00000.safetensors  chunks c0, c1, ..., four tensors each:
        c<i>.rows     int64[n]        row numbers (into keys) of the chunk's n arrays
        c<i>.shapes   int64[n, ndim]  each array's shape
        c<i>.offsets  int64[n + 1]    where each array starts and ends in .data, in elements
        c<i>.data     <dtype>[total]  the arrays, flattened and concatenated

A chunk holds one (field, dtype, ndim) group's arrays, or a run of them when the group does not
fit in the current shard; shards close at about ``shard_bytes`` (one array larger than that gets
a shard to itself). No pickle: JSON, and safetensors via :mod:`rollsafe.tensorfile`.
"""

from __future__ import annotations

import builtins
import hashlib
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, Final, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollsafe.dataplane.protocol import DataPlaneManifest, ExportedFile, Row
from rollsafe.errors import DataPlaneKeyMissing, InvalidInput, SchemaMismatch, SnapshotCorrupt
from rollsafe.tensorfile import HashingWriter, dtype_name, read_tensors, write_tensors

FORMAT_VERSION: Final = 1
INDEX_FILE = "index.json"
DEFAULT_SHARD_BYTES = 256 << 20
_PARTITION = re.compile(r"[A-Za-z0-9._-]{1,64}")
_PARTS = ("rows", "shapes", "offsets", "data")

_Rows = dict[str, dict[str, np.ndarray]]
_Group = tuple[str, str, int]  # field, safetensors dtype name, ndim
_Entries = list[tuple[int, np.ndarray]]  # (row number, array)


class _Chunk(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    shard: str = Field(description="file name inside the partition directory")
    tensor: str = Field(description="prefix of the chunk's four tensors in the shard")
    field: str
    dtype: str = Field(description="safetensors dtype name of the .data tensor")
    ndim: int = Field(ge=0, le=64)
    rows: int = Field(ge=1)


class _PartitionIndex(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format_version: Literal[1]  # FORMAT_VERSION
    partition: str
    keys: list[str]
    chunks: list[_Chunk]


class MemoryDataPlane:
    """Rows held in this process; see the module docstring for the copy rules and the layout."""

    name = "memory"

    def __init__(self, shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        if shard_bytes < 1:
            raise InvalidInput(f"shard_bytes must be positive, got {shard_bytes}")
        self._shard_bytes = shard_bytes
        self._data: dict[str, _Rows] = {}
        self._lock = threading.Lock()

    def put(self, partition: str, rows: Mapping[str, Row]) -> None:
        _check_partition(partition)
        if not isinstance(rows, Mapping):
            raise InvalidInput(f"rows must map key -> row, got {type(rows).__name__}")
        # Copy and check the whole batch before storing any of it: a bad row stores nothing.
        staged = {_check_key(key): _copy_row(partition, key, row) for key, row in rows.items()}
        if staged:
            with self._lock:
                self._data.setdefault(partition, {}).update(staged)

    def get(self, partition: str, keys: Iterable[str]) -> dict[str, dict[str, np.ndarray]]:
        _check_partition(partition)
        wanted = _key_list(keys)
        with self._lock:
            stored = self._data.get(partition, {})
            missing = {key for key in wanted if key not in stored}
            if missing:
                raise DataPlaneKeyMissing(partition, missing)
            # A view of a read-only array cannot be made writeable, so callers cannot reach in.
            return {key: {f: a.view() for f, a in stored[key].items()} for key in wanted}

    def list(self, partition: str) -> builtins.list[str]:
        _check_partition(partition)
        with self._lock:
            return sorted(self._data.get(partition, ()))

    def count(self, partition: str) -> int:
        _check_partition(partition)
        with self._lock:
            return len(self._data.get(partition, ()))

    def delete(self, partition: str, keys: Iterable[str]) -> None:
        _check_partition(partition)
        wanted = set(_key_list(keys))
        with self._lock:
            stored = self._data.get(partition, {})
            missing = wanted - stored.keys()
            if missing:
                raise DataPlaneKeyMissing(partition, missing)
            for key in wanted:
                del stored[key]
            if not stored:
                self._data.pop(partition, None)

    def clear(self, partition: str | None = None) -> None:
        with self._lock:
            if partition is None:
                self._data = {}
            else:
                _check_partition(partition)
                self._data.pop(partition, None)

    def partitions(self) -> builtins.list[str]:
        with self._lock:
            return sorted(name for name, rows in self._data.items() if rows)

    def export(self, directory: Path) -> DataPlaneManifest:
        directory = Path(directory)
        _prepare_empty_directory(directory)
        with self._lock:
            picture = {name: dict(rows) for name, rows in self._data.items() if rows}
        files: builtins.list[ExportedFile] = []
        for partition in sorted(picture):
            _export_partition(directory, partition, picture[partition], self._shard_bytes, files)
        _fsync_directory(directory)
        counts = {name: len(rows) for name, rows in sorted(picture.items())}
        return DataPlaneManifest(
            format_version=FORMAT_VERSION, backend=self.name, partitions=counts, files=files
        )

    def import_(self, directory: Path, manifest: DataPlaneManifest) -> None:
        if manifest.backend != self.name or manifest.format_version != FORMAT_VERSION:
            raise SchemaMismatch(
                f"data plane export is backend {manifest.backend!r} format_version "
                f"{manifest.format_version}; this is {self.name!r} format_version {FORMAT_VERSION}"
            )
        with self._lock:
            self._require_empty()  # before reading what may be gigabytes
        contents = _read_verified(Path(directory), manifest)
        _check_file_placement(contents, manifest)
        loaded = {n: _decode_partition(n, c, contents) for n, c in manifest.partitions.items()}
        with self._lock:
            self._require_empty()
            self._data = loaded

    def _require_empty(self) -> None:  # the caller holds the lock
        if self._data:
            names = sorted(self._data)
            raise InvalidInput(f"import_ needs an empty data plane; it holds {names} (clear() it)")


# -- checks and copies on the way in ------------------------------------------------------------


def _check_partition(name: object, error: type[Exception] = InvalidInput) -> None:
    # '.' and '..' match the character class but would walk the directory tree on export.
    if not (isinstance(name, str) and _PARTITION.fullmatch(name) and name not in {".", ".."}):
        raise error(f"partition name {name!r} must be 1-64 of [A-Za-z0-9._-], not '.' or '..'")


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise InvalidInput(f"data plane key must be a non-empty string, got {key!r}")
    return key


def _key_list(keys: Iterable[str]) -> builtins.list[str]:
    # A bare string is iterable too; reading it as single-character keys would be a silent bug.
    if isinstance(keys, str):
        raise InvalidInput(f"keys must be an iterable of keys, not the string {keys!r}")
    return [_check_key(key) for key in keys]


def _copy_row(partition: str, key: str, row: object) -> dict[str, np.ndarray]:
    if not isinstance(row, Mapping):
        raise InvalidInput(f"{partition}/{key!r}: a row maps field -> array, got {type(row)}")
    copied: dict[str, np.ndarray] = {}
    for field, value in row.items():
        where = f"partition {partition!r} key {key!r} field {field!r}"
        if not isinstance(field, str):
            raise InvalidInput(f"{where}: field names must be strings")
        if not isinstance(value, np.ndarray):
            raise InvalidInput(f"{where}: expected a numpy array, got {type(value).__name__}")
        # Refused here, not when a checkpoint exports far from the put that caused it.
        # Big-endian too: safetensors would make it little-endian, so not an exact round trip.
        if not _exportable(value.dtype):
            raise InvalidInput(f"{where}: dtype {value.dtype.str} cannot be exported")
        array = np.array(value, copy=True, order="C")
        array.setflags(write=False)
        copied[field] = array
    return copied


def _exportable(dtype: np.dtype[Any]) -> bool:
    try:
        dtype_name(dtype)
    except ValueError:
        return False
    return dtype.byteorder != ">"


# -- export -------------------------------------------------------------------------------------


def _prepare_empty_directory(directory: Path) -> None:
    if directory.exists() or directory.is_symlink():
        if not directory.is_dir():
            raise InvalidInput(f"export target {directory} exists and is not a directory")
        if any(directory.iterdir()):
            raise InvalidInput(f"export target {directory} is not empty")
    directory.mkdir(parents=True, exist_ok=True)


def _export_partition(
    root: Path, partition: str, rows: _Rows, shard_bytes: int, files: builtins.list[ExportedFile]
) -> None:
    keys = sorted(rows)
    groups: dict[_Group, _Entries] = {}
    for number, key in enumerate(keys):
        for field, array in rows[key].items():
            group = (field, dtype_name(array.dtype), array.ndim)
            groups.setdefault(group, []).append((number, array))
    (root / partition).mkdir()
    chunks: builtins.list[_Chunk] = []
    for shard_number, pieces in enumerate(_plan_shards(groups, shard_bytes)):
        shard = f"shard-{shard_number:05d}.safetensors"
        tensors: dict[str, np.ndarray] = {}
        for (field, dtype, ndim), entries in pieces:
            tensor = f"c{len(chunks)}"
            tensors.update(_encode_chunk(tensor, entries, ndim))
            chunk = _Chunk(
                shard=shard, tensor=tensor, field=field, dtype=dtype, ndim=ndim, rows=len(entries)
            )
            chunks.append(chunk)
        with _hashed_file(root, f"{partition}/{shard}", files) as out:
            write_tensors(out, tensors)
    index = _PartitionIndex(
        format_version=FORMAT_VERSION, partition=partition, keys=keys, chunks=chunks
    )
    with _hashed_file(root, f"{partition}/{INDEX_FILE}", files) as out:
        out.write(index.model_dump_json().encode())
    _fsync_directory(root / partition)


def _plan_shards(
    groups: dict[_Group, _Entries], limit: int
) -> Iterator[builtins.list[tuple[_Group, _Entries]]]:
    """Cut the groups, in order, into shards of about ``limit`` bytes (headers not counted)."""
    shard: builtins.list[tuple[_Group, _Entries]] = []
    used = 0
    for group in sorted(groups):
        for entry in groups[group]:
            cost = entry[1].nbytes + 8 * (group[2] + 2)  # + its row number, offset and shape
            if used and used + cost > limit:
                yield shard
                shard, used = [], 0
            if not shard or shard[-1][0] != group:
                shard.append((group, []))
            shard[-1][1].append(entry)
            used += cost
    if shard:
        yield shard


def _encode_chunk(tensor: str, entries: _Entries, ndim: int) -> dict[str, np.ndarray]:
    arrays = [array for _, array in entries]
    count = len(arrays)
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum([array.size for array in arrays], out=offsets[1:])
    return {
        f"{tensor}.rows": np.array([number for number, _ in entries], dtype=np.int64),
        f"{tensor}.shapes": np.array([a.shape for a in arrays], np.int64).reshape(count, ndim),
        f"{tensor}.offsets": offsets,
        f"{tensor}.data": np.concatenate([array.reshape(-1) for array in arrays]),
    }


@contextmanager
def _hashed_file(
    root: Path, relative: str, files: builtins.list[ExportedFile]
) -> Iterator[HashingWriter]:
    with open(root / relative, "xb") as handle:
        out = HashingWriter(handle)
        yield out
        handle.flush()
        os.fsync(handle.fileno())
    files.append(ExportedFile(path=relative, sha256=out.hexdigest(), bytes=out.size))


def _fsync_directory(directory: Path) -> None:
    # Makes the new directory entries themselves durable, not only the files' contents.
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# -- import -------------------------------------------------------------------------------------


def _read_verified(directory: Path, manifest: DataPlaneManifest) -> dict[str, bytes]:
    """Every listed file's bytes, after checking the directory holds exactly those files, each
    with the listed size and sha256. Decoding later reads these same bytes, never the disk."""
    if not directory.is_dir():
        raise SnapshotCorrupt(f"{directory}: data plane export directory is missing")
    listed: dict[str, ExportedFile] = {}
    for entry in manifest.files:
        if not _clean_relative(entry.path) or entry.path in listed:
            raise SnapshotCorrupt(f"{directory}: manifest path {entry.path!r} unsafe or repeated")
        listed[entry.path] = entry
    present = _walk_files(directory)
    if unlisted := sorted(present - listed.keys()):
        raise SnapshotCorrupt(f"{directory}: files not in the manifest: {', '.join(unlisted)}")
    if absent := sorted(listed.keys() - present):
        raise SnapshotCorrupt(f"{directory}: files in the manifest missing: {', '.join(absent)}")
    contents: dict[str, bytes] = {}
    for path, entry in sorted(listed.items()):
        data = (directory / path).read_bytes()
        if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise SnapshotCorrupt(f"{directory / path}: sha256 or size differs from the manifest")
        contents[path] = data
    return contents


def _clean_relative(path: str) -> bool:
    pure = PurePosixPath(path)
    return (
        not pure.is_absolute()
        and pure.as_posix() == path
        and "\\" not in path
        and all(part not in {"", ".", ".."} for part in pure.parts)
    )


def _walk_files(directory: Path) -> set[str]:
    def refuse(error: OSError) -> None:
        raise SnapshotCorrupt(f"{directory}: cannot list ({error})")

    found: set[str] = set()
    for folder, subfolders, names in os.walk(directory, onerror=refuse):
        for name in (*subfolders, *names):
            path = Path(folder, name)
            # A link could point anywhere; an export never writes one.
            if path.is_symlink() or not (path.is_file() or path.is_dir()):
                raise SnapshotCorrupt(f"{path}: not a regular file or directory")
        found.update(Path(folder, name).relative_to(directory).as_posix() for name in names)
    return found


def _check_file_placement(contents: Mapping[str, bytes], manifest: DataPlaneManifest) -> None:
    for name, count in manifest.partitions.items():
        _check_partition(name, SnapshotCorrupt)
        if count < 1:
            raise SnapshotCorrupt(f"manifest partition {name!r} has {count} rows")
    for path in contents:
        head, _, rest = path.partition("/")
        if head not in manifest.partitions or not rest or "/" in rest:
            raise SnapshotCorrupt(f"{path}: not a file of a partition named in the manifest")


def _decode_partition(partition: str, expected_rows: int, contents: Mapping[str, bytes]) -> _Rows:
    prefix = f"{partition}/"
    mine = {path[len(prefix) :]: data for path, data in contents.items() if path.startswith(prefix)}
    source = f"{partition}/{INDEX_FILE}"
    if INDEX_FILE not in mine:
        raise SnapshotCorrupt(f"{source}: missing")
    index = _parse_index(source, mine.pop(INDEX_FILE))
    if index.partition != partition:
        raise SnapshotCorrupt(f"{source}: names partition {index.partition!r}")
    if len(index.keys) != expected_rows:
        raise SnapshotCorrupt(f"{source}: {len(index.keys)} rows, manifest says {expected_rows}")
    if len(set(index.keys)) != len(index.keys) or not all(index.keys):
        raise SnapshotCorrupt(f"{source}: keys are repeated or empty")
    if len({(c.shard, c.tensor) for c in index.chunks}) != len(index.chunks):
        raise SnapshotCorrupt(f"{source}: a chunk is listed twice")
    if {chunk.shard for chunk in index.chunks} != mine.keys():
        raise SnapshotCorrupt(f"{source}: chunk table does not match files {sorted(mine)}")
    rows: _Rows = {key: {} for key in index.keys}
    for shard in sorted(mine):
        shard_source = f"{partition}/{shard}"
        tensors, _ = read_tensors(mine[shard], shard_source)
        chunks = [chunk for chunk in index.chunks if chunk.shard == shard]
        if set(tensors) != {f"{c.tensor}.{part}" for c in chunks for part in _PARTS}:
            raise SnapshotCorrupt(f"{shard_source}: tensors do not match {source}")
        for chunk in chunks:
            try:
                _decode_chunk(chunk, tensors, index.keys, rows, shard_source)
            except (ValueError, IndexError) as exc:
                raise SnapshotCorrupt(f"{shard_source}: chunk {chunk.tensor}: {exc}") from None
    return rows


def _parse_index(source: str, data: bytes) -> _PartitionIndex:
    # The manifest's format_version governs; an index of another version is inconsistent.
    try:
        return _PartitionIndex.model_validate_json(data, strict=True)
    except ValidationError as exc:
        raise SnapshotCorrupt(f"{source}: {exc}") from None


def _decode_chunk(
    chunk: _Chunk, tensors: Mapping[str, np.ndarray], keys: Sequence[str], rows: _Rows, source: str
) -> None:
    numbers, shapes, offsets, data = (tensors[f"{chunk.tensor}.{part}"] for part in _PARTS)
    count = chunk.rows
    if not (
        numbers.dtype == shapes.dtype == offsets.dtype == np.dtype(np.int64)
        and numbers.shape == (count,)
        and shapes.shape == (count, chunk.ndim)
        and offsets.shape == (count + 1,)
        and data.ndim == 1
        and dtype_name(data.dtype) == chunk.dtype
    ):
        raise SnapshotCorrupt(f"{source}: chunk {chunk.tensor} does not match its index entry")
    # Negative row numbers would index keys from the end, so bounds are checked, not trusted.
    in_range = numbers.min() >= 0 and numbers.max() < len(keys) and (shapes >= 0).all()
    sizes = np.prod(shapes, axis=1, dtype=np.int64)
    ends_match = offsets[0] == 0 and offsets[-1] == data.size
    if not (in_range and ends_match and (np.diff(offsets) == sizes).all()):
        raise SnapshotCorrupt(f"{source}: chunk {chunk.tensor} has inconsistent rows or offsets")
    starts, ends = offsets[:-1].tolist(), offsets[1:].tolist()
    for number, shape, begin, end in zip(
        numbers.tolist(), shapes.tolist(), starts, ends, strict=True
    ):
        row = rows[keys[number]]
        if chunk.field in row:
            raise SnapshotCorrupt(f"{source}: {keys[number]!r} has field {chunk.field!r} twice")
        # A copy, so that a row does not keep the whole file's buffer alive.
        array = data[begin:end].reshape(shape).copy()
        array.setflags(write=False)
        row[chunk.field] = array
