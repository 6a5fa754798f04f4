"""The journal's on-disk format: segments of framed, checksummed, versioned records.

::

    segment  = header record*
    header   = b"RSJOURNL" | u16 version (2) | u16 n | run id (n bytes, UTF-8)
               | journal id (16 bytes) | u64 first record id
               | u32 crc32 of the header's bytes before it
    record   = u32 body length | u32 crc32(body) | body
    body     = u64 record id | u8 kind | u32 m | meta (m bytes: a JSON object)
               | row (seals only: the row's arrays in the tensorfile format)

Integers are little-endian. The journal id is minted when a run's journal folder gets its first
segment and is the same in every segment after it (and named in every snapshot's manifest): a
segment of another journal, even one of a run with the same id, is told apart from this one's.
Version 1 headers (an earlier rollsafe's: no journal id) are still read.

Record ids go up by one from the header's first id, so a record applied twice is recognised by
its id and a missing one is seen at once. Reading stops at the first record that is *torn*
(fewer bytes than its frame says: the tail a crash cut off) or *corrupt* (a checksum or id that
does not match): it is never skipped over, since nothing after it can be trusted to be the
run's next change, and the stop says where and why. Nothing is pickled: metadata is JSON, a
row's arrays are raw little-endian bytes with dtype and shape.

Pure: bytes in, bytes out; writing and syncing segments is another module's business.
"""

from __future__ import annotations

import io
import json
import secrets
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rollsafe.core.ids import validate_run_id
from rollsafe.core.states import RecordKind as RecordKind  # the kinds are the core's
from rollsafe.dataplane import Row
from rollsafe.errors import InvalidInput, JournalCorrupt, SnapshotCorrupt
from rollsafe.snapshot.bounded import parse_json
from rollsafe.snapshot.tensorfile import HashingWriter, read_tensors, write_tensors

MAGIC = b"RSJOURNL"
FORMAT_VERSION = 2
READS = (1, 2)  # version 1: an earlier rollsafe's header, without a journal id
JOURNAL_ID_BYTES = 16
_HEADER_FIXED = struct.Struct("<8sHH")  # magic, version, run id length
_FIRST_ID = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_FRAME = struct.Struct("<II")  # body length, crc32(body)
_BODY = struct.Struct("<QBI")  # record id, kind, meta length
MAX_BODY = 1 << 30  # a larger length is a corrupt frame, not a record to allocate for


@dataclass(frozen=True)
class Record:
    id: int
    kind: RecordKind
    meta: Mapping[str, Any]  # JSON: what the change needs (groups, step, attempt, ...)
    row: Row | None = None  # a seal's training row


@dataclass(frozen=True)
class SegmentHeader:
    run_id: str
    first_id: int
    size: int  # bytes: where the first record starts
    journal_id: str | None = None  # hex; None in a version 1 header


def new_journal_id() -> str:
    return secrets.token_hex(JOURNAL_ID_BYTES)


@dataclass(frozen=True)
class Stop:
    """Where reading stopped before the end of the data, and why."""

    offset: int  # of the record's frame
    record: int  # the id the record there should have had: the first one not read
    reason: Literal["torn", "corrupt"]
    detail: str


@dataclass
class Decoded:
    records: list[Record] = field(default_factory=list)
    end: int = 0  # the offset just past the last good record
    stop: Stop | None = None


def encode_header(run_id: str, first_id: int, journal_id: str) -> bytes:
    name = validate_run_id(run_id).encode()
    if first_id < 0:
        raise InvalidInput(f"a journal's first record id is >= 0, got {first_id}")
    identity = _journal_id_bytes(journal_id)
    head = (
        _HEADER_FIXED.pack(MAGIC, FORMAT_VERSION, len(name))
        + name
        + identity
        + _FIRST_ID.pack(first_id)
    )
    return head + _CRC.pack(zlib.crc32(head))


def _journal_id_bytes(journal_id: str) -> bytes:
    try:
        identity = bytes.fromhex(journal_id)
    except ValueError:
        identity = b""
    if len(identity) != JOURNAL_ID_BYTES:
        raise InvalidInput(f"a journal id is {2 * JOURNAL_ID_BYTES} hex digits, got {journal_id!r}")
    return identity


def decode_header(data: bytes | memoryview, source: str) -> SegmentHeader:
    """The segment's header; :class:`JournalCorrupt` naming ``source`` and what is wrong."""
    view = memoryview(data)
    if len(view) < _HEADER_FIXED.size:
        raise JournalCorrupt(f"{source}: too short for a journal header ({len(view)} bytes)")
    magic, version, n = _HEADER_FIXED.unpack_from(view)
    if magic != MAGIC:
        raise JournalCorrupt(f"{source}: not a rollsafe journal segment (magic {magic!r})")
    if version not in READS:
        raise JournalCorrupt(
            f"{source}: journal format version {version}; this rollsafe reads {READS}"
        )
    identity = JOURNAL_ID_BYTES if version >= 2 else 0
    size = _HEADER_FIXED.size + n + identity + _FIRST_ID.size + _CRC.size
    if len(view) < size:
        raise JournalCorrupt(f"{source}: truncated journal header")
    (crc,) = _CRC.unpack_from(view, size - _CRC.size)
    if zlib.crc32(view[: size - _CRC.size]) != crc:
        raise JournalCorrupt(f"{source}: journal header checksum does not match")
    at = _HEADER_FIXED.size
    try:
        run_id = bytes(view[at : at + n]).decode()
    except UnicodeDecodeError:
        raise JournalCorrupt(f"{source}: the header's run id is not UTF-8") from None
    journal_id = bytes(view[at + n : at + n + identity]).hex() if identity else None
    (first_id,) = _FIRST_ID.unpack_from(view, at + n + identity)
    return SegmentHeader(run_id=run_id, first_id=first_id, size=size, journal_id=journal_id)


def encode_record(record: Record) -> bytes:
    """One framed record. :class:`InvalidInput` for metadata JSON cannot hold, a row on a
    record that is not a seal, or a seal without its row."""
    if (record.row is not None) != (record.kind == RecordKind.SEAL):
        raise InvalidInput(f"record {record.id}: a row goes with a seal, and only with one")
    try:
        meta = json.dumps(dict(record.meta), separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"record {record.id}: metadata is not JSON: {exc}") from None
    body = _BODY.pack(record.id, record.kind, len(meta)) + meta
    if record.row is not None:
        out = io.BytesIO()
        write_tensors(HashingWriter(out), record.row)
        body += out.getvalue()
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def decode_records(data: bytes | memoryview, header: SegmentHeader, source: str) -> Decoded:
    """Every whole, intact record after the header, in order; the first torn or corrupt one
    stops the reading (:attr:`Decoded.stop`), and nothing after it is returned."""
    view = memoryview(data)
    offset = header.size
    expected = header.first_id
    decoded = Decoded(end=offset)
    while offset < len(view):
        record, stop = _one(view, offset, expected, source)
        if stop is not None:
            decoded.stop = stop
            return decoded
        assert record is not None
        decoded.records.append(record)
        offset += _FRAME.size + _frame_length(view, offset)
        decoded.end = offset
        expected += 1
    return decoded


def _frame_length(view: memoryview, offset: int) -> int:
    return int(_FRAME.unpack_from(view, offset)[0])


def _one(
    view: memoryview, offset: int, expected: int, source: str
) -> tuple[Record | None, Stop | None]:
    left = len(view) - offset
    if left < _FRAME.size:
        return None, Stop(offset, expected, "torn", f"{left} bytes, less than a record's frame")
    length, crc = _FRAME.unpack_from(view, offset)
    if length > MAX_BODY or length < _BODY.size:
        return None, Stop(offset, expected, "corrupt", f"impossible record length {length}")
    body = view[offset + _FRAME.size : offset + _FRAME.size + length]
    if len(body) < length:
        return None, Stop(offset, expected, "torn", f"{len(body)} of the record's {length} bytes")
    if zlib.crc32(body) != crc:
        return None, Stop(offset, expected, "corrupt", "checksum does not match")
    record_id, kind, meta_length = _BODY.unpack_from(body)
    if record_id != expected:
        return None, Stop(
            offset, expected, "corrupt", f"record id {record_id} where {expected} is next"
        )
    try:
        return _record(body, record_id, kind, meta_length, f"{source}@{offset}"), None
    except (InvalidInput, SnapshotCorrupt) as exc:  # checksummed yet malformed: written wrong
        return None, Stop(offset, expected, "corrupt", str(exc))


def _record(body: memoryview, record_id: int, kind: int, meta_length: int, where: str) -> Record:
    try:
        known = RecordKind(kind)
    except ValueError:
        raise InvalidInput(f"{where}: unknown record kind {kind}") from None
    meta_end = _BODY.size + meta_length
    if meta_end > len(body):
        raise InvalidInput(f"{where}: metadata runs past the record")
    try:
        meta = parse_json(bytes(body[_BODY.size : meta_end]))
    except ValueError as exc:
        raise InvalidInput(f"{where}: unreadable metadata ({exc})") from None
    if not isinstance(meta, dict):
        raise InvalidInput(f"{where}: metadata is not a JSON object")
    rest = body[meta_end:]
    if known == RecordKind.SEAL:
        arrays, _ = read_tensors(rest, where)
        return Record(record_id, known, meta, {k: v.copy() for k, v in arrays.items()})
    if len(rest):
        raise InvalidInput(f"{where}: {len(rest)} bytes after a record that carries no row")
    return Record(record_id, known, meta)
