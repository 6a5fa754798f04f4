"""Journal segments on disk: appended with group commit, read back in order.

A run's journal is a folder of segment files, ``<first record id, 20 digits>.rsj``, each in the
format of :mod:`rollsafe.journal.format`. :class:`JournalWriter` appends to the newest one:
records are buffered and written with one ``fsync`` per batch, at most ``flush_ms`` after the
first record of the batch, and a caller that must not go on before its record is durable waits
for its batch (:meth:`JournalWriter.append_durable`). A segment is never replaced: a new one
takes an id above every segment and record the folder holds. :func:`read_journal` reads every
segment in order, stops a segment's reading at its first torn or corrupt record (reported), and
stops reading the folder at the first segment that is not this journal's next one (a problem,
reported; never skipped over).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from rollsafe.core.config import JOURNAL_FLUSH_MS
from rollsafe.dataplane import Row
from rollsafe.errors import InvalidInput, JournalCorrupt, JournalFailed, JournalGap
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
from rollsafe.journal.head import HEAD_NAME, Head, read_head, write_head
from rollsafe.snapshot.bounded import read_regular

log = logging.getLogger(__name__)
SUFFIX = ".rsj"
DRAFT_SUFFIX = ".draft"  # a new segment's header, before it takes its name
_SEGMENT_NAME = re.compile(r"[0-9]{20}\.rsj")
DEFAULT_FLUSH_MS = JOURNAL_FLUSH_MS
# How long a record may take to become durable before its waiter is told the disk does not
# sync (JournalFailed): a healthy disk syncs a batch in milliseconds; a stalled or full one
# must fail the call that waits, loudly, rather than hang every seal, hand-out and commit.
DURABLE_WAIT_S = 120.0

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
        journal_id: str,
        *,
        flush_ms: float | None = DEFAULT_FLUSH_MS,
        fsync: Fsync = os.fsync,
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.run_id = run_id
        self.journal_id = journal_id
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
        # A write or sync that failed: the records it held are not durable, and the segment
        # takes no more (a torn batch may end the file); every later call raises it.
        self._failure: JournalFailed | None = None
        self.flushes = 0  # batches written (each one fsync)
        self._flusher: threading.Thread | None = None
        if flush_ms is not None:
            self._flush_s = flush_ms / 1000
            self._flusher = threading.Thread(target=self._flush_loop, daemon=True)
            self._flusher.start()

    def append(self, kind: RecordKind, meta: Mapping[str, Any], row: Row | None = None) -> int:
        """Buffer one record; its id. Not durable until its batch is flushed."""
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._closed:
                raise InvalidInput(f"journal segment {self.path} is closed")
            record_id = self._next_id
            self._buffer.append(encode_record(Record(record_id, kind, meta, row)))
            self._next_id += 1
            self._work.notify()
            return record_id

    def wait_durable(self, record_id: int, timeout_s: float = DURABLE_WAIT_S) -> None:
        """Block until record ``record_id`` is written and synced. :class:`JournalFailed` when
        its write or sync failed (naming the segment and the disk's error), or when it is not
        durable within ``timeout_s``. Without a background flush, flushes first."""
        if self._flusher is None:
            self.flush()
        with self._lock:
            self._synced.wait_for(
                lambda: self._durable >= record_id or self._failure is not None, timeout_s
            )
            if self._durable >= record_id:
                return
            if self._failure is not None:
                raise self._failure
        raise JournalFailed(
            f"journal segment {self.path}: record {record_id} not durable within "
            f"{timeout_s:g} s: the disk under {self.directory} does not sync"
        )

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
        object-storage mirror deal in whole segments). Returns the closed segment's path. A
        segment that holds no record yet is kept open: its successor would need its name."""
        with self._writing:
            next_id = self._flush_locked()
            closed = self.path
            if next_id == self.first_id:
                return closed
            self._file.close()
            self._file = self._new_segment(next_id)
            return closed

    def _flush_locked(self) -> int:
        """Write and sync the buffered batch; returns the id the next batch starts at. A write
        or sync that fails fails the segment (:class:`JournalFailed`, raised here and to every
        waiter and later call)."""
        with self._lock:
            if self._failure is not None:
                raise self._failure
            batch, self._buffer = self._buffer, []
            next_id = self._next_id
        if batch:
            try:
                self._file.write(b"".join(batch))
                self._sync()
            except OSError as exc:
                raise self._fail(next_id - len(batch), next_id - 1, exc) from exc
        with self._lock:
            self.flushes += bool(batch)
            self._durable = max(self._durable, next_id - 1)
            self._synced.notify_all()
        return next_id

    def _fail(self, first: int, last: int, exc: BaseException) -> JournalFailed:
        """Fail the segment: whether records ``first``..``last`` reached the disk is not known
        (a write may have, its sync not), so no caller is told they are durable, and the run
        must restart: its restore takes what the journal holds as the truth."""
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc)
        failure = JournalFailed(
            f"journal segment {self.path}: writing records {first}-{last} failed ({reason}): "
            "they are not known durable (a restore reads whatever reached the disk), and the "
            f"journal takes no more; free or fix the disk under {self.directory}, then restart "
            "the run (it restores from its snapshot and the journal)"
        )
        with self._lock:
            if self._failure is None:
                self._failure = failure
            self._synced.notify_all()
            self._work.notify_all()
            return self._failure

    def _new_segment(self, first_id: int) -> BinaryIO:
        """A segment holding only its header, durable under its final name, and named by
        ``HEAD`` first (:mod:`rollsafe.journal.head`). A file already there is never replaced,
        whatever it holds: what a restore could not read stays as it was (docs/journal.md)."""
        path = self.directory / segment_name(first_id)
        if os.path.lexists(path):
            raise InvalidInput(f"journal segment {path} exists: a segment is never replaced")
        draft = path.with_name(path.name + DRAFT_SUFFIX)
        _remove_stale_draft(draft)
        with open(draft, "xb") as out:
            out.write(encode_header(self.run_id, first_id, self.journal_id))
            out.flush()
            self._fsync(out.fileno())
        write_head(
            self.directory, Head(run_id=self.run_id, journal_id=self.journal_id, newest=first_id)
        )
        os.link(draft, path)  # unlike a rename, fails rather than replace a file made meanwhile
        draft.unlink()
        _sync_directory(self.directory, self._fsync)
        self.path, self.first_id = path, first_id  # the open segment's
        return path.open("ab")

    def close(self) -> None:
        """Flush what is buffered and close the segment; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._work.notify_all()
        if self._flusher is not None:
            self._flusher.join()
        try:
            if self._failure is None:  # a failed segment's lost records were said so already
                self.flush()
        finally:
            self._file.close()

    def _flush_loop(self) -> None:
        while True:
            with self._lock:
                self._work.wait_for(lambda: bool(self._buffer) or self._closed)
                if self._closed or self._failure is not None:
                    return
            time.sleep(self._flush_s)  # the group's window: more records join the batch
            try:
                self.flush()
            except JournalFailed:
                return  # recorded: its waiters and every later call raise it
            except Exception as exc:  # a bug, not the disk: still never a hang
                self._fail(self._durable + 1, self.last_id, exc)
                log.exception("journal flusher of %s failed", self.path)
                return

    def _sync(self) -> None:
        self._file.flush()
        self._fsync(self._file.fileno())


def _remove_stale_draft(draft: Path) -> None:
    """A draft a crash left (a header nobody renamed: it never held a record) goes; anything
    else under a draft's name is refused by name rather than removed."""
    if not os.path.lexists(draft):
        return
    if draft.is_dir() and not draft.is_symlink():
        raise JournalCorrupt(f"{draft}: a folder where a segment's draft is written")
    draft.unlink()


def _sync_directory(directory: Path, fsync: Fsync) -> None:
    """A new segment's name is durable once its folder is synced."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        fsync(descriptor)
    finally:
        os.close(descriptor)


def segment_id(name: str) -> int | None:
    """The first record id a canonical segment name holds; None for any other name."""
    return int(name.removesuffix(SUFFIX)) if _SEGMENT_NAME.fullmatch(name) else None


def list_segments(directory: Path) -> tuple[list[tuple[int, Path]], list[Path]]:
    """The segments of a journal folder in order, with their first ids (from their names),
    and the entries named like segments that are not (``*.rsj`` spelled otherwise)."""
    segments: list[tuple[int, Path]] = []
    strays: list[Path] = []
    for name in sorted(os.listdir(directory)):
        if (first := segment_id(name)) is not None:
            segments.append((first, directory / name))
        elif name.endswith(SUFFIX):
            strays.append(directory / name)
    return segments, strays


@dataclass(frozen=True)
class Segment:
    path: Path
    first_id: int


@dataclass(frozen=True)
class JournalStop:
    """A record reading stopped at (torn or corrupt), in the segment that holds it.
    ``superseded``: a restore went on after it (its segment follows); the segment stays as it
    is, so every later reading finds and reports the stop again."""

    segment: Path
    stop: Stop
    superseded: bool = False

    def describe(self) -> str:
        stop = self.stop
        return (
            f"{self.segment}: {stop.reason} record {stop.record} at offset {stop.offset} "
            f"({stop.detail})"
        )


def current_stop(stops: list[JournalStop]) -> JournalStop | None:
    """The stop that ends a reading: the last one, unless a restore went on after it."""
    last = stops[-1] if stops else None
    return last if last is not None and not last.superseded else None


@dataclass
class JournalRead:
    """What a journal folder holds, read in order up to the first thing that is wrong with it.

    ``records``: every record of the usable segments, up to the first torn or corrupt record
    that no restore went on after. ``problems``: why the rest cannot be read as this journal's
    history (a segment missing, of another journal, not a segment, not following); a restore
    refuses them unless told to accept the loss. ``unusable``: the files those problems name
    and every segment after them (a restore that accepts the loss sets them aside)."""

    records: list[Record] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)  # the usable ones, in order
    stops: list[JournalStop] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    unusable: list[Path] = field(default_factory=list)
    journal_id: str | None = None  # of the segments (None: none, or an earlier rollsafe's)
    highest_id: int = 0  # the highest record id or segment start seen: new ids go above it

    @property
    def end(self) -> int | None:
        """The id of the last good record; None for a journal without records."""
        return self.records[-1].id if self.records else None

    @property
    def stop(self) -> Stop | None:
        """The stop that ends the reading (none superseded it), if any."""
        current = current_stop(self.stops)
        return current.stop if current is not None else None

    @property
    def stopped_in(self) -> Path | None:
        current = current_stop(self.stops)
        return current.segment if current is not None else None

    def refuse_problems(self) -> None:
        """:class:`JournalGap` naming the first problem, if there is one, and the way out."""
        if self.problems:
            raise journal_gap(self.problems)


def journal_gap(problems: list[str]) -> JournalGap:
    """The refusal naming the first of ``problems`` (a journal that does not continue its
    snapshot), and the way out."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return JournalGap(
        f"{problems[0]}{more}; a restore told to accept_journal_loss goes on without what "
        "does not continue the snapshot"
    )


def read_journal(directory: Path, run_id: str, *, head_optional: bool = False) -> JournalRead:
    """Every record of the run's journal under ``directory``, in order (nothing is changed on
    disk). Reading a segment stops at its first torn or corrupt record, reported with the
    segment, the offset and the record's id. Where a segment stopped or ended before the next
    one starts, only a segment a *restore* opened may follow: it starts with the restore's
    RESTART record, and that restore read the journal up to that point, so what lies between
    was never part of the run's history (a torn tail, or records its snapshot covered).
    Anything else (a gap, a segment of another run or journal, a file named like a segment
    that is not one, a newest segment ``HEAD`` names and the folder lacks) is a problem
    (:attr:`JournalRead.problems`): reading never skips over it to go on with later records.
    :class:`JournalCorrupt` only when ``directory`` is not a folder at all. ``head_optional``:
    segments fetched from a mirror, with no ``HEAD`` of their own to check them against."""
    read = JournalRead()
    if not os.path.lexists(directory):
        return read
    if directory.is_symlink() or not directory.is_dir():
        raise JournalCorrupt(f"{directory}: the journal's place holds something not a folder")
    segments, strays = list_segments(directory)
    read.problems += [f"{path}: named like a journal segment, and is not one" for path in strays]
    read.unusable += strays
    _Reader(read, run_id).read_all(segments)
    _check_head(directory, read, segments, head_optional)
    return read


class _Reader:
    """Reads segments in order into a :class:`JournalRead`."""

    def __init__(self, read: JournalRead, run_id: str) -> None:
        self.read = read
        self.run_id = run_id
        self.expected: int | None = None  # the id the next record must have
        self.stopped = False  # the last segment read ended at a stop (or before its end)

    def read_all(self, segments: list[tuple[int, Path]]) -> None:
        for first_id, path in segments:
            self.read.highest_id = max(self.read.highest_id, first_id)
            if self.read.problems:  # nothing after a problem is this journal's history
                self.read.unusable.append(path)
                continue
            problem = self._segment(first_id, path)
            if problem is not None:
                self.read.problems.append(problem)
                self.read.unusable.append(path)

    def _segment(self, first_id: int, path: Path) -> str | None:
        """Reads one segment; the problem that makes it unusable, if any."""
        try:
            data = read_regular(path)
            header = decode_header(data, str(path))
        except OSError as exc:
            return f"{path}: unreadable ({exc})"
        except JournalCorrupt as exc:
            return str(exc)
        if header.run_id != self.run_id:
            return f"{path}: a segment of run {header.run_id!r}, not {self.run_id!r}"
        if header.first_id != first_id:
            return f"{path}: its header says it starts at record {header.first_id}"
        if (problem := self._identity(path, header.journal_id)) is not None:
            return problem
        decoded = decode_records(data, header, str(path))
        if decoded.records:
            self.read.highest_id = max(self.read.highest_id, decoded.records[-1].id)
        follows = self.expected is None or (first_id == self.expected and not self.stopped)
        if not follows and not _opened_by_restore(decoded, first_id, self.expected):
            return _not_following(path, first_id, self.expected, self.read.stops)
        self._take(path, first_id, decoded)
        return None

    def _identity(self, path: Path, journal_id: str | None) -> str | None:
        known = self.read.journal_id
        if journal_id is None and known is not None:
            return f"{path}: an earlier rollsafe's segment after segments of journal {known}"
        if known is not None and journal_id != known:
            return f"{path}: a segment of journal {journal_id}, not {known}"
        self.read.journal_id = journal_id
        return None

    def _take(self, path: Path, first_id: int, decoded: Decoded) -> None:
        read = self.read
        read.segments.append(Segment(path, first_id))
        read.records += decoded.records
        if not decoded.records and decoded.stop is None and self.expected is not None:
            return  # only a header (a crashed restore's, or the open one): nothing changes
        if read.stops and self.stopped:  # a restore went on after the stop before it
            read.stops[-1] = dataclasses.replace(read.stops[-1], superseded=True)
        self.expected = first_id + len(decoded.records)
        self.stopped = decoded.stop is not None
        if decoded.stop is not None:
            read.stops.append(JournalStop(path, decoded.stop))


def _opened_by_restore(decoded: Decoded, first_id: int, expected: int | None) -> bool:
    if not decoded.records:
        return decoded.stop is None  # only a header: a restore that never wrote its record
    first = decoded.records[0]
    return expected is not None and first_id >= expected and first.kind == RecordKind.RESTART


def _not_following(
    path: Path, first_id: int, expected: int | None, stops: list[JournalStop]
) -> str:
    if stops and not stops[-1].superseded:
        return (
            f"{stops[-1].describe()}, and {path.name} holds later records (from {first_id}): "
            "reading never skips a bad record"
        )
    before = (expected or 0) - 1
    return (
        f"{path}: starts at record {first_id}, the segment before it ends at {before} "
        f"(records {before + 1}..{first_id - 1} missing)"
    )


def _check_head(
    directory: Path, read: JournalRead, segments: list[tuple[int, Path]], optional: bool
) -> None:
    """The newest segment ``HEAD`` names is there (or its draft: a crash between naming it and
    renaming it), and ``HEAD`` is this journal's."""
    try:
        head = read_head(directory)
    except JournalCorrupt as exc:
        read.problems.append(str(exc))
        return
    if head is None:
        if read.journal_id is not None and not optional:  # an earlier rollsafe's have none
            read.problems.append(
                f"{directory / HEAD_NAME}: missing: whether newer segments existed is unknown"
            )
        return
    read.highest_id = max(read.highest_id, head.newest)
    if read.journal_id is not None and head.journal_id != read.journal_id:
        read.problems.append(
            f"{directory / HEAD_NAME}: names journal {head.journal_id}, the segments are of "
            f"journal {read.journal_id}"
        )
    name = segment_name(head.newest)
    drafted = os.path.lexists(directory / (name + DRAFT_SUFFIX))
    if head.newest not in {first for first, _ in segments} and not drafted:
        read.problems.append(f"{directory / name}: missing: the newest segment (named by HEAD)")
