"""Columns of numbers on disk in the safetensors layout, written and hashed in one pass.

The layout is safetensors' own (8-byte little-endian header length, a JSON header naming each
array's dtype, shape and byte range, then the raw bytes), so the files open with the
``safetensors`` library too. rollsafe writes them itself because that library copies
everything into one ``bytes`` before writing (0.24 s for 40 MB here): this writer streams each
array's buffer straight to the file and hashes it on the way, which keeps a snapshot close to
the disk's own speed. Nothing here can execute code on load: only numbers and strings.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, NamedTuple

import numpy as np

from rollsafe.errors import SnapshotCorrupt
from rollsafe.snapshot.bounded import parse_json

# safetensors dtype names <-> numpy dtypes (only the ones rollsafe writes).
_DTYPES: dict[str, np.dtype[np.generic]] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32),
    "U64": np.dtype(np.uint64),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_MAX_HEADER = 100 << 20


# Hashing a large buffer and writing it both release the GIL, so one worker thread hashes
# while the caller's thread writes; and after each chunk the kernel is asked to start writing
# it back, so the final fsync finds little left to do. Together a snapshot file costs about
# what a plain write + fsync of its bytes costs (measured in bench/snapshot_bench.py: hashing
# then writing took 1.8x a plain write; overlapped with early writeback, 1.05x).
_HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollsafe-sha256")
_OVERLAP_BYTES = 1 << 20
_CHUNK_BYTES = 8 << 20


class HashingWriter:
    """Writes to a binary file while computing sha256 and counting bytes."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._hash = hashlib.sha256()
        self.size = 0
        self._fd, self._base = _fd_and_offset(file)

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        if view.nbytes < _OVERLAP_BYTES:
            self._hash.update(view)
            self._file.write(view)
            self.size += view.nbytes
            return
        view = view.cast("B")
        for start in range(0, view.nbytes, _CHUNK_BYTES):
            piece = view[start : start + _CHUNK_BYTES]
            hashed = _HASHER.submit(self._hash.update, piece)
            try:
                self._file.write(piece)
                self._start_writeback(len(piece))
            finally:
                hashed.result()
            self.size += len(piece)

    def _start_writeback(self, length: int) -> None:
        # POSIX_FADV_DONTNEED on dirty pages makes Linux start writing them back without
        # waiting; elsewhere (or for a BytesIO) there is nothing to do.
        if self._fd is not None and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, self._base + self.size, length, os.POSIX_FADV_DONTNEED)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _fd_and_offset(file: BinaryIO) -> tuple[int | None, int]:
    try:
        return file.fileno(), file.tell()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None, 0


def dtype_name(dtype: np.dtype[np.generic]) -> str:
    try:
        return _NAMES[dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors name") from None


def write_tensors(
    out: HashingWriter, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``arrays`` (C-contiguous little-endian copies are made only when needed)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    ordered = []
    offset = 0
    for name in sorted(arrays):
        array = np.require(arrays[name], requirements="C")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        header[name] = {
            "dtype": dtype_name(array.dtype),
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        ordered.append(array)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    out.write(struct.pack("<Q", len(encoded)))
    out.write(encoded)
    for array in ordered:
        if array.nbytes:
            out.write(array.data.cast("B"))


def read_tensors(
    data: bytes | memoryview, source: str
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse a safetensors buffer; arrays are read-only views into ``data``.

    Refused with :class:`SnapshotCorrupt` naming ``source``: a short buffer; an unreadable
    header; an entry whose dtype is not one rollsafe writes, or whose shape or offsets are not
    non-negative integers; a byte range that does not fit its dtype and shape, or the body;
    and a layout that does not tile the body. Taken in offset order, the ranges must start at
    0, each must begin where the one before ends, and the last must end with the body: two
    that overlap, or a gap, are refused naming both tensors and their offsets, as safetensors
    refuses them ("invalid offset"), and so are bytes after the last ("not fully covered").
    """
    view = memoryview(data)
    if len(view) < 8:
        raise SnapshotCorrupt(f"{source}: truncated (no header)")
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > _MAX_HEADER or 8 + header_len > len(view):
        raise SnapshotCorrupt(f"{source}: truncated or invalid header length {header_len}")
    try:
        header = parse_json(bytes(view[8 : 8 + header_len]))
    except ValueError as exc:
        raise SnapshotCorrupt(f"{source}: unreadable header ({exc})") from None
    if not isinstance(header, dict):
        raise SnapshotCorrupt(f"{source}: header is not an object")
    metadata = header.pop("__metadata__", {}) or {}
    body = view[8 + header_len :]
    arrays: dict[str, np.ndarray] = {}
    ranges: list[_Range] = []
    for name, spec in header.items():
        arrays[name], begin, end = _array_from_spec(name, spec, body, source)
        ranges.append(_Range(begin, end, name))
    covered = _check_layout(ranges, source)
    if covered != len(body):
        raise SnapshotCorrupt(f"{source}: body is {len(body)} bytes, header describes {covered}")
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SnapshotCorrupt(f"{source}: __metadata__ must map strings to strings")
    return arrays, metadata


class _Range(NamedTuple):
    begin: int
    end: int
    name: str


def _check_layout(ranges: list[_Range], source: str) -> int:
    """Where the tensors' bytes end, once checked to follow one another from 0 with neither
    overlap nor gap (safetensors' own rule, its "invalid offset"). Two ranges sharing bytes
    would alias one array's data in another; a gap is bytes no tensor accounts for, which the
    file's hash would cover unread."""
    before = _Range(0, 0, "")
    for this in sorted(ranges):  # by (begin, end): an empty range first among equal begins
        if this.begin < before.end:
            raise SnapshotCorrupt(
                f"{source}: tensors {before.name!r} at {before.begin}..{before.end} and "
                f"{this.name!r} at {this.begin}..{this.end} overlap"
            )
        if this.begin > before.end:
            after = f"after {before.name!r} at {before.begin}..{before.end}"
            raise SnapshotCorrupt(
                f"{source}: gap of {this.begin - before.end} bytes before {this.name!r} at "
                f"{this.begin}..{this.end} ({after if before.name else 'the body starts at 0'})"
            )
        before = this
    return before.end


def _array_from_spec(
    name: str, spec: object, body: memoryview, source: str
) -> tuple[np.ndarray, int, int]:
    """The array ``spec`` describes, with its byte range (begin, end) in ``body``."""
    try:
        assert isinstance(spec, dict)
        dtype = _DTYPES[spec["dtype"]]
        shape = _counts(spec["shape"])
        begin, end = _counts(spec["data_offsets"])
    except (AssertionError, KeyError, TypeError, ValueError):
        raise SnapshotCorrupt(f"{source}: bad header entry for {name!r}") from None
    count = math.prod(shape)  # exact: numpy's int64 product could wrap round to fit
    if not begin <= end <= len(body) or end - begin != count * dtype.itemsize:
        raise SnapshotCorrupt(f"{source}: {name!r} byte range {begin}..{end} does not fit")
    return np.frombuffer(body[begin:end], dtype=dtype).reshape(shape), begin, end


def _counts(values: object) -> tuple[int, ...]:
    """A JSON list of non-negative integers (safetensors' usize), or ValueError: a string or a
    float is not one, and a negative dimension would let numpy infer the shape."""
    if not isinstance(values, list) or not all(type(n) is int and n >= 0 for n in values):
        raise ValueError(values)
    return tuple(values)
