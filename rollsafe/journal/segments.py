"""Journal segments on disk: appended with group commit, read back in order.

A run's journal is a folder of segment files, ``<first record id, 20 digits>.rsj``, each in the
format of :mod:`rollsafe.journal.format`. :class:`JournalWriter` appends to the newest one:
records are buffered and written with one ``fsync`` per batch, at most ``flush_ms`` after the
first record of the batch, and a caller that must not go on before its record is durable waits
for its batch (:meth:`JournalWriter.append_durable`). :func:`read_journal` reads every segment
in order and stops at the first torn or corrupt record, or at a segment that does not follow
the one before it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from rollsafe.core.config import JOURNAL_FLUSH_MS
from rollsafe.dataplane import Row
from rollsafe.errors import InvalidInput, JournalCorrupt
from rollsafe.journal.format import (
    Decoded,
    Record,
    RecordKind,
    Stop,
    decode_header,
    decode_records,
    encode_header,
    encode_record,
)

SUFFIX = ".rsj"
DEFAULT_FLUSH_MS = JOURNAL_FLUSH_MS

Fsync = Callable[[int], None]


def segment_name(first_id: int) -> str:
    return f"{first_id:020d}{SUFFIX}"


class JournalWriter:
    """Appends records to a new segment starting at ``first_id``. ``flush_ms=None``: no
    background flush; :meth:`flush` writes and syncs what is buffered (tests, and close)."""

    def __init__(
        self,
        directory: Path,
        run_id: str,
        first_id: int,
        *,
        flush_ms: float | None = DEFAULT_FLUSH_MS,
        fsync: Fsync = os.fsync,
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.run_id = run_id
        self._fsync = fsync
        self._file = self._new_segment(first_id)
        # One lock, two conditions: appends wake only the flusher, a flush wakes the waiters
        # once (64 sealers woken by every append would spend the batch window on the GIL).
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the flusher: records to write, or closed
        self._synced = threading.Condition(self._lock)  # the waiters: a batch is durable
        self._writing = threading.Lock()
        self._buffer: list[bytes] = []
        self._next_id = first_id
        self._durable = first_id - 1  # the highest record id written and synced
        self._closed = False
        self.flushes = 0  # batches written (each one fsync)
        self._flusher: threading.Thread | None = None
        if flush_ms is not None:
            self._flush_s = flush_ms / 1000
            self._flusher = threading.Thread(target=self._flush_loop, daemon=True)
            self._flusher.start()

    def append(self, kind: RecordKind, meta: Mapping[str, Any], row: Row | None = None) -> int:
        """Buffer one record; its id. Not durable until its batch is flushed."""
        with self._lock:
            if self._closed:
                raise InvalidInput(f"journal segment {self.path} is closed")
            record_id = self._next_id
            self._buffer.append(encode_record(Record(record_id, kind, meta, row)))
            self._next_id += 1
            self._work.notify()
            return record_id

    def wait_durable(self, record_id: int, timeout_s: float | None = None) -> bool:
        """Block until record ``record_id`` is written and synced; False after ``timeout_s``.
        Without a background flush, flushes what is buffered first."""
        if self._flusher is None:
            self.flush()
        with self._lock:
            return self._synced.wait_for(lambda: self._durable >= record_id, timeout_s)

    def append_durable(
        self, kind: RecordKind, meta: Mapping[str, Any], row: Row | None = None
    ) -> int:
        """:meth:`append`, returning once the record is durable (its batch synced)."""
        record_id = self.append(kind, meta, row)
        self.wait_durable(record_id)
        return record_id

    @property
    def last_id(self) -> int:
        """The id of the last record appended (durable or not); first_id - 1 before any."""
        with self._lock:
            return self._next_id - 1

    @property
    def holds_records(self) -> bool:
        """Whether records were appended since the open segment began."""
        return self.last_id >= self.first_id

    def flush(self) -> None:
        """Write and sync every record buffered now, as one batch."""
        with self._writing:  # batches reach the file in the order they were taken
            self._flush_locked()

    def rotate(self) -> Path:
        """Close this segment and go on in a new one; safe beside appends: what is buffered
        goes into the old segment, ids from the next one into the new (compaction and the
        object-storage mirror deal in whole segments). Returns the closed segment's path."""
        with self._writing:
            next_id = self._flush_locked()
            closed = self.path
            self._file.close()
            self._file = self._new_segment(next_id)
            return closed

    def _flush_locked(self) -> int:
        """Write and sync the buffered batch; returns the id the next batch starts at."""
        with self._lock:
            batch, self._buffer = self._buffer, []
            next_id = self._next_id
        if batch:
            self._file.write(b"".join(batch))
            self._sync()
        with self._lock:
            self.flushes += bool(batch)
            self._durable = max(self._durable, next_id - 1)
            self._synced.notify_all()
        return next_id

    def _new_segment(self, first_id: int) -> BinaryIO:
        """A segment holding only its header, durable under its final name. A segment of that
        name is replaced only when it holds no whole record (a torn tail left by a crash)."""
        self.path = self.directory / segment_name(first_id)
        self.first_id = first_id  # the open segment's
        if self.path.exists() and _holds_records(self.path, self.run_id):
            raise InvalidInput(f"journal segment {self.path} exists: a writer never appends twice")
        draft = self.path.with_suffix(".tmp")
        with draft.open("wb") as out:
            out.write(encode_header(self.run_id, first_id))
            out.flush()
            self._fsync(out.fileno())
        draft.replace(self.path)
        _sync_directory(self.directory, self._fsync)
        return self.path.open("ab")

    def close(self) -> None:
        """Flush what is buffered and close the segment; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._work.notify_all()
        if self._flusher is not None:
            self._flusher.join()
        self.flush()
        self._file.close()

    def _flush_loop(self) -> None:
        while True:
            with self._lock:
                self._work.wait_for(lambda: bool(self._buffer) or self._closed)
                if self._closed:
                    return
            time.sleep(self._flush_s)  # the group's window: more records join the batch
            self.flush()

    def _sync(self) -> None:
        self._file.flush()
        self._fsync(self._file.fileno())


def _holds_records(path: Path, run_id: str) -> bool:
    data = path.read_bytes()
    try:
        header = decode_header(data, str(path))
    except JournalCorrupt:
        return False  # a header torn by a crash: nothing in it was ever durable
    if header.run_id != run_id:
        return True  # another run's: never overwritten
    return bool(decode_records(data, header, str(path)).records)


def _sync_directory(directory: Path, fsync: Fsync) -> None:
    """A new segment's name is durable once its folder is synced."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        fsync(descriptor)
    finally:
        os.close(descriptor)


@dataclass(frozen=True)
class Segment:
    path: Path
    first_id: int


@dataclass
class JournalRead:
    records: list[Record] = field(default_factory=list)
    stop: Stop | None = None
    stopped_in: Path | None = None  # the segment where reading stopped
    segments: list[Segment] = field(default_factory=list)  # in order, the last one included

    @property
    def end(self) -> int | None:
        """The id of the last good record; None for a journal without records."""
        return self.records[-1].id if self.records else None


def read_journal(directory: Path, run_id: str) -> JournalRead:
    """Every record of the run's journal under ``directory``, in order, up to the first torn or
    corrupt record. :class:`JournalCorrupt` for a segment of another run or one that does not
    follow the one before it (a record missing between them); nothing is changed on disk.

    Where a segment stopped (torn or corrupt) or ended before the next one starts, only a
    segment a *restore* opened may follow: it starts with the restore's RESTART record, and
    the restore read the journal up to that point, so what lies between was never part of the
    run's history (a torn tail, or records its snapshot covered). Anything else after a stop
    is refused: reading never skips a bad record to go on with later ones."""
    read = JournalRead()
    expected: int | None = None
    stopped: tuple[Stop, Path] | None = None
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        data = path.read_bytes()
        header = decode_header(data, str(path))
        if header.run_id != run_id:
            raise JournalCorrupt(f"{path}: a segment of run {header.run_id!r}, not {run_id!r}")
        decoded = decode_records(data, header, str(path))
        follows = expected is None or (header.first_id == expected and stopped is None)
        if not follows and not _opened_by_restore(decoded, header.first_id, expected):
            raise _not_following(path, header.first_id, expected, stopped)
        read.segments.append(Segment(path, header.first_id))
        read.records += decoded.records
        if decoded.records or expected is None:
            expected = header.first_id + len(decoded.records)
            stopped = (decoded.stop, path) if decoded.stop is not None else None
    if stopped is not None:
        read.stop, read.stopped_in = stopped
    return read


def _opened_by_restore(decoded: Decoded, first_id: int, expected: int | None) -> bool:
    if not decoded.records:
        return decoded.stop is None  # only a header: a restore that never wrote its record
    first = decoded.records[0]
    return expected is not None and first_id >= expected and first.kind == RecordKind.RESTART


def _not_following(
    path: Path, first_id: int, expected: int | None, stopped: tuple[Stop, Path] | None
) -> JournalCorrupt:
    if stopped is not None:
        stop, where = stopped
        return JournalCorrupt(
            f"{where}: {stop.reason} record at offset {stop.offset} ({stop.detail}), and "
            f"{path.name} holds later records (from {first_id}): reading never skips a bad "
            "record"
        )
    return JournalCorrupt(
        f"{path}: starts at record {first_id}, the segment before it ends at {(expected or 0) - 1}"
    )
