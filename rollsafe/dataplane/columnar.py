"""The data plane's export format, one for every backend (docs/design.md section 9).

An export is columnar, so its cost follows the bytes, not the row count::

    <partition>/index.json               keys (row number i is keys[i]) and the chunk table
    <partition>/shard-00000.safetensors  chunks c0, c1, ..., four tensors each:
        c<i>.rows     int64[n]        row numbers (into keys) of the chunk's n arrays
        c<i>.shapes   int64[n, ndim]  each array's shape
        c<i>.offsets  int64[n + 1]    where each array starts and ends in .data, in elements
        c<i>.data     <dtype>[total]  the arrays, flattened and concatenated

A chunk holds one (field, dtype, ndim) group's arrays among the rows of its shard. Rows are
added in key order and a shard closes at about ``shard_bytes`` (one array larger than that
gets a shard to itself), so a writer holds at most one shard's rows: a backend that streams
rows out of a remote store never holds the whole partition. No pickle: JSON, and safetensors
via :mod:`rollsafe.snapshot.tensorfile`. The format names no backend: an export from one backend
imports into any other (a TransferQueue run's snapshot opens in the memory plane).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Final, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollsafe.dataplane import BACKENDS
from rollsafe.dataplane.protocol import DataPlaneManifest, ExportedFile, Row
from rollsafe.dataplane.rows import check_partition
from rollsafe.errors import ContentMismatch, InvalidInput, SchemaMismatch, SnapshotCorrupt
from rollsafe.snapshot.bounded import read_regular
from rollsafe.snapshot.tensorfile import HashingWriter, dtype_name, read_tensors, write_tensors

FORMAT_VERSION: Final = 1
INDEX_FILE = "index.json"
DEFAULT_SHARD_BYTES = 256 << 20
_PARTS = ("rows", "shapes", "offsets", "data")

Rows = dict[str, dict[str, np.ndarray]]
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


def check_manifest(manifest: DataPlaneManifest, importer: str) -> None:
    if manifest.backend not in BACKENDS or manifest.format_version != FORMAT_VERSION:
        raise SchemaMismatch(
            f"data plane export is backend {manifest.backend!r} format_version "
            f"{manifest.format_version}; {importer!r} reads format_version {FORMAT_VERSION} "
            f"from backends {', '.join(BACKENDS)}"
        )


# -- export -------------------------------------------------------------------------------------


RowSource = Callable[[str, Sequence[str]], Iterable[tuple[str, Row]]]


def write_export(
    directory: Path,
    backend: str,
    keys: Mapping[str, Sequence[str]],
    rows_of: RowSource,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> DataPlaneManifest:
    """Export every partition named in ``keys`` (partition -> its keys, sorted here) into the
    empty ``directory``; ``rows_of(partition, keys)`` yields ``(key, row)`` in that order."""
    directory = Path(directory)
    prepare_empty_directory(directory)
    files: list[ExportedFile] = []
    counts: dict[str, int] = {}
    for partition in sorted(keys):
        ordered = sorted(keys[partition])
        if not ordered:
            continue
        writer = PartitionWriter(directory, partition, ordered, files, shard_bytes)
        for key, row in rows_of(partition, ordered):
            writer.add(key, row)
        writer.close()
        counts[partition] = len(ordered)
    fsync_directory(directory)
    return DataPlaneManifest(
        format_version=FORMAT_VERSION, backend=backend, partitions=counts, files=files
    )


def prepare_empty_directory(directory: Path) -> None:
    if directory.exists() or directory.is_symlink():
        if not directory.is_dir():
            raise InvalidInput(f"export target {directory} exists and is not a directory")
        if any(directory.iterdir()):
            raise InvalidInput(f"export target {directory} is not empty")
    directory.mkdir(parents=True, exist_ok=True)


class PartitionWriter:
    """Writes one partition's rows, added in the order of ``keys``, one shard at a time."""

    def __init__(
        self,
        root: Path,
        partition: str,
        keys: Sequence[str],
        files: list[ExportedFile],
        shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> None:
        if shard_bytes < 1:
            raise InvalidInput(f"shard_bytes must be positive, got {shard_bytes}")
        self._root, self._partition, self._files = root, partition, files
        self._keys = list(keys)
        self._limit = shard_bytes
        self._next_row = 0
        self._pending: dict[_Group, _Entries] = {}
        self._used = 0
        self._chunks: list[_Chunk] = []
        self._shards = 0
        (root / partition).mkdir()

    def add(self, key: str, row: Row) -> None:
        number = self._next_row
        if number >= len(self._keys) or self._keys[number] != key:
            expected = self._keys[number] if number < len(self._keys) else "nothing"
            raise InvalidInput(f"{self._partition}: row {key!r} added out of order ({expected})")
        self._next_row += 1
        for field in sorted(row):
            array = row[field]
            cost = array.nbytes + 8 * (array.ndim + 2)  # + its row number, offset and shape
            if self._used and self._used + cost > self._limit:
                self._flush()
            group = (field, dtype_name(array.dtype), array.ndim)
            self._pending.setdefault(group, []).append((number, array))
            self._used += cost

    def close(self) -> None:
        if self._next_row != len(self._keys):
            raise InvalidInput(
                f"{self._partition}: {len(self._keys) - self._next_row} rows were never added"
            )
        self._flush()
        index = _PartitionIndex(
            format_version=FORMAT_VERSION,
            partition=self._partition,
            keys=self._keys,
            chunks=self._chunks,
        )
        with _hashed_file(self._root, f"{self._partition}/{INDEX_FILE}", self._files) as out:
            out.write(index.model_dump_json().encode())
        fsync_directory(self._root / self._partition)

    def _flush(self) -> None:
        if not self._pending:
            return
        shard = f"shard-{self._shards:05d}.safetensors"
        tensors: dict[str, np.ndarray] = {}
        for (field, dtype, ndim), entries in sorted(self._pending.items()):
            tensor = f"c{len(self._chunks)}"
            tensors.update(_encode_chunk(tensor, entries, ndim))
            self._chunks.append(
                _Chunk(
                    shard=shard,
                    tensor=tensor,
                    field=field,
                    dtype=dtype,
                    ndim=ndim,
                    rows=len(entries),
                )
            )
        with _hashed_file(self._root, f"{self._partition}/{shard}", self._files) as out:
            write_tensors(out, tensors)
        self._shards += 1
        self._pending, self._used = {}, 0


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
def _hashed_file(root: Path, relative: str, files: list[ExportedFile]) -> Iterator[HashingWriter]:
    with open(root / relative, "xb") as handle:
        out = HashingWriter(handle)
        yield out
        handle.flush()
        os.fsync(handle.fileno())
    files.append(ExportedFile(path=relative, sha256=out.hexdigest(), bytes=out.size))


def fsync_directory(directory: Path) -> None:
    # Makes the new directory entries themselves durable, not only the files' contents.
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# -- import -------------------------------------------------------------------------------------


def read_export(directory: Path, manifest: DataPlaneManifest) -> dict[str, Rows]:
    """Every partition's rows, after checking every file against the manifest."""
    contents = read_verified(Path(directory), manifest)
    check_file_placement(contents, manifest)
    return {n: _decode_partition(n, c, contents) for n, c in manifest.partitions.items()}


def read_verified(directory: Path, manifest: DataPlaneManifest) -> dict[str, bytes]:
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
        try:
            data = read_regular(directory / path, limit=entry.bytes)
        except OSError as exc:
            raise ContentMismatch(f"{directory / path}: unreadable ({exc})") from None
        if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ContentMismatch(f"{directory / path}: sha256 or size differs from the manifest")
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


def check_file_placement(contents: Mapping[str, bytes], manifest: DataPlaneManifest) -> None:
    for name, count in manifest.partitions.items():
        check_partition(name, SnapshotCorrupt)
        if count < 1:
            raise SnapshotCorrupt(f"manifest partition {name!r} has {count} rows")
    for path in contents:
        head, _, rest = path.partition("/")
        if head not in manifest.partitions or not rest or "/" in rest:
            raise SnapshotCorrupt(f"{path}: not a file of a partition named in the manifest")


def _decode_partition(partition: str, expected_rows: int, contents: Mapping[str, bytes]) -> Rows:  # noqa: C901 (each check names its own damage)
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
    rows: Rows = {key: {} for key in index.keys}
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
    chunk: _Chunk, tensors: Mapping[str, np.ndarray], keys: Sequence[str], rows: Rows, source: str
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
