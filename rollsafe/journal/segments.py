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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollsafe.dataplane import Row
from rollsafe.errors import InvalidInput, JournalCorrupt
from rollsafe.journal.format import (
    Record,
    RecordKind,
    Stop,
    decode_header,
    decode_records,
    encode_header,
    encode_record,
)

SUFFIX = ".rsj"
# Group commit: a batch is written and synced at most this long after its first record. The
# default is to be chosen from bench/journal_bench.py (issue 20, item 6).
DEFAULT_FLUSH_MS = 2.0

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
        self.path = directory / segment_name(first_id)
        if self.path.exists():
            raise InvalidInput(f"journal segment {self.path} exists: a writer never appends twice")
        self._fsync = fsync
        self._file = self.path.open("xb")
        self._file.write(encode_header(run_id, first_id))
        self._sync()
        _sync_directory(directory, fsync)
        self._changed = threading.Condition()
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
        with self._changed:
            if self._closed:
                raise InvalidInput(f"journal segment {self.path} is closed")
            record_id = self._next_id
            self._buffer.append(encode_record(Record(record_id, kind, meta, row)))
            self._next_id += 1
            self._changed.notify_all()
            return record_id

    def wait_durable(self, record_id: int, timeout_s: float | None = None) -> bool:
        """Block until record ``record_id`` is written and synced; False after ``timeout_s``."""
        with self._changed:
            return self._changed.wait_for(lambda: self._durable >= record_id, timeout_s)

    def append_durable(
        self, kind: RecordKind, meta: Mapping[str, Any], row: Row | None = None
    ) -> int:
        """:meth:`append`, returning once the record is durable (its batch synced)."""
        record_id = self.append(kind, meta, row)
        if self._flusher is None:
            self.flush()
        self.wait_durable(record_id)
        return record_id

    def flush(self) -> None:
        """Write and sync every record buffered now, as one batch."""
        with self._writing:  # batches reach the file in the order they were taken
            with self._changed:
                batch, self._buffer = self._buffer, []
                last = self._next_id - 1
            if batch:
                self._file.write(b"".join(batch))
                self._sync()
        with self._changed:
            self.flushes += bool(batch)
            self._durable = max(self._durable, last)
            self._changed.notify_all()

    def close(self) -> None:
        """Flush what is buffered and close the segment; idempotent."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
        if self._flusher is not None:
            self._flusher.join()
        self.flush()
        self._file.close()

    def _flush_loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._buffer) or self._closed)
                if self._closed:
                    return
                # The group's window: more records join the batch until it closes.
                self._changed.wait_for(lambda: self._closed, self._flush_s)
            self.flush()

    def _sync(self) -> None:
        self._file.flush()
        self._fsync(self._file.fileno())


def _sync_directory(directory: Path, fsync: Fsync) -> None:
    """A new segment's name is durable once its folder is synced."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        fsync(descriptor)
    finally:
        os.close(descriptor)


@dataclass
class JournalRead:
    records: list[Record] = field(default_factory=list)
    stop: Stop | None = None
    stopped_in: Path | None = None  # the segment where reading stopped


def read_journal(directory: Path, run_id: str) -> JournalRead:
    """Every record of the run's journal under ``directory``, in order, up to the first torn or
    corrupt record. :class:`JournalCorrupt` for a segment of another run or one that does not
    follow the one before it (a record missing between them); nothing is changed on disk."""
    read = JournalRead()
    expected: int | None = None
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        data = path.read_bytes()
        header = decode_header(data, str(path))
        if header.run_id != run_id:
            raise JournalCorrupt(f"{path}: a segment of run {header.run_id!r}, not {run_id!r}")
        if expected is not None and header.first_id != expected:
            raise JournalCorrupt(
                f"{path}: starts at record {header.first_id}, the segment before it ends "
                f"at {expected - 1}"
            )
        decoded = decode_records(data, header, str(path))
        read.records += decoded.records
        expected = header.first_id + len(decoded.records)
        if decoded.stop is not None:
            read.stop, read.stopped_in = decoded.stop, path
            break
    return read
