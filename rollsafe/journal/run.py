"""A run's journal folder (``<snapshot root>/<run id>/journal/``): the run state appends to it,
a restore replays it after the snapshot it restored, a publish compacts it.

Lifecycle:

- a run that starts (fresh, or over) appends after whatever the folder holds
  (:meth:`RunJournal.start`; a folder that held records gets a ``start_over`` restart first,
  so no snapshot of the earlier run can be brought forward across it);
- a restore reads the journal, replays the records after the snapshot's position and goes on
  in a new segment that starts with the restore's own RESTART record
  (:meth:`RunJournal.replayer`, handed to ``state_files.restore``). Nothing is written before the
  restore succeeded (:meth:`RunJournal.resume`), and then nothing is replaced: the new
  segment's id is above every segment and record the folder holds, a segment reading stopped
  in stays as it is (every later restore reports its stop again), and what a restore told to
  accept a loss did not apply is moved, whole, into ``set-aside/``;
- after a publish the writer moves to a new segment and every segment wholly covered by the
  oldest snapshot retention keeps is deleted (:meth:`RunJournal.compact`): never before the
  snapshot that covers it is published, and a restore falling back to an older retained
  snapshot still finds the records after it; a segment reading stopped in is set aside
  rather than deleted;
- on object storage the folder lives beside the local cache, and a *mirror* copies it to the
  bucket: every ``mirror_every_s`` the open segment is closed (if it holds new records) and
  every closed segment not yet copied is uploaded (:meth:`RunJournal.mirror_now`); a restore
  on a host without them downloads the segments it lacks first.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollsafe.core.config import JOURNAL_MIRROR_S
from rollsafe.core.run_state import JOURNAL_POSITION, Replay, RunState
from rollsafe.dataplane import Row
from rollsafe.errors import InvalidInput, JournalCorrupt
from rollsafe.journal.format import RecordKind, decode_header, decode_records, new_journal_id
from rollsafe.journal.head import HEAD_NAME, read_head
from rollsafe.journal.replay import Covered, Replayed, replay
from rollsafe.journal.segments import (
    DEFAULT_FLUSH_MS,
    Fsync,
    JournalWriter,
    list_segments,
    read_journal,
    segment_id,
)
from rollsafe.snapshot import (
    SnapshotReader,
    SnapshotStore,
    accept_at_or_below,
    accept_weight_versions,
)
from rollsafe.snapshot._fs import fsync_dir
from rollsafe.snapshot.bounded import read_regular
from rollsafe.snapshot.select import Accept
from rollsafe.snapshot.state_files import ReplayJournal
from rollsafe.snapshot.store import FolderMirror

JOURNAL_DIR = "journal"
SET_ASIDE_DIR = "set-aside"  # inside the journal's folder: what no restore will read again
log = logging.getLogger(__name__)


class RunJournal:
    """The run's journal: :class:`~rollsafe.core.run_state.JournalSink` for its run state."""

    def __init__(
        self,
        directory: Path,
        run_id: str,
        *,
        flush_ms: float | None = DEFAULT_FLUSH_MS,
        fsync: Fsync = os.fsync,
        mirror: FolderMirror | None = None,
        mirror_every_s: float | None = None,
    ) -> None:
        """``mirror``: where closed segments are copied (object storage), every
        ``mirror_every_s`` by a thread of its own (None: only when :meth:`mirror_now` or
        :meth:`compact` is called)."""
        self.directory = directory
        self.run_id = run_id
        self.flush_ms = flush_ms
        self._fsync = fsync
        self._writer: JournalWriter | None = None
        self.journal_id: str | None = None  # known once started or restored
        self._mirror = mirror
        self._mirrored: set[str] = set()  # segment names already copied
        # Held by whatever swaps, closes or deletes segments: the mirror's thread among them.
        self._segments_lock = threading.RLock()
        self.replayed: Replayed | None = None  # what the last restore replayed
        # A restore in progress: the id its new segment starts at, and its RESTART record's
        # metadata once made. Nothing is written before the restore succeeded (resume()).
        self._resume_at: int | None = None
        self._restart: Mapping[str, Any] | None = None
        self._resumes_journal: str | None = None  # the journal the restored run goes on in
        # Segments the last reading stopped in: compaction sets them aside, never deletes.
        self._damaged: set[Path] = set()
        self._stop = threading.Event()
        self._mirror_thread: threading.Thread | None = None
        if mirror is not None and mirror_every_s is not None:  # last: it reads the above
            self._mirror_thread = threading.Thread(
                target=self._mirror_loop, args=(mirror_every_s,), daemon=True
            )
            self._mirror_thread.start()

    @classmethod
    def for_store(
        cls,
        store: SnapshotStore,
        *,
        flush_ms: float | None = DEFAULT_FLUSH_MS,
        mirror_every_s: float | None = JOURNAL_MIRROR_S,
    ) -> RunJournal:
        """The journal beside ``store``'s snapshots; for object storage, beside its local
        cache and mirrored to the bucket every ``mirror_every_s`` (docs/journal.md)."""
        return cls(
            store.run_dir / JOURNAL_DIR,
            store.run_id,
            flush_ms=flush_ms,
            mirror=store.mirror(JOURNAL_DIR),
            mirror_every_s=mirror_every_s,
        )

    # ---- the sink ---------------------------------------------------------------------------

    def append(self, kind: RecordKind, meta: Mapping[str, Any], row: Row | None = None) -> int:
        if self._resume_at is None:
            return self._open_writer().append(kind, meta, row)
        if kind != RecordKind.RESTART or self._restart is not None:
            raise InvalidInput(
                f"run {self.run_id}: a restore is in progress; only its restart is recorded "
                "before it succeeds"
            )
        self._restart = dict(meta)
        return self._resume_at

    @property
    def last_id(self) -> int:
        if self._resume_at is not None:
            return self._resume_at - (self._restart is None)
        return self._open_writer().last_id

    def wait_durable(self, record_id: int) -> None:
        self._open_writer().wait_durable(record_id)

    def _open_writer(self) -> JournalWriter:
        if self._writer is None:
            raise InvalidInput(
                f"run {self.run_id}: the journal is not open (start the run or restore it first)"
            )
        return self._writer

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self, state: RunState) -> None:
        """``state`` starts the run (fresh, or over): it appends after what the folder holds."""
        first_id, self.journal_id = self._next_start()
        self._open(first_id)
        if first_id > 1:
            self.append(RecordKind.RESTART, {"why": "start_over"})
        state.journal = self

    def replayer(
        self, weight_version: int | None = None, *, accept_loss: bool = False
    ) -> ReplayJournal:
        """For ``state_files.restore(journal=...)`` (rollsafe.snapshot): replays the journal
        after the restored snapshot (commits past ``weight_version`` rolled back), then attaches
        this journal to the restored state in a new segment after everything read.
        ``accept_loss``: go on although the journal does not continue the snapshot
        (RestoreRequest's ``accept_journal_loss``)."""

        def bring_forward(state: RunState, reader: SnapshotReader) -> Replay:
            if self._writer is not None:  # a live run restoring: its own records first
                self._writer.flush()
            head_local = self._fetch_missing()
            read = read_journal(self.directory, self.run_id, head_optional=not head_local)
            manifest = reader.manifest
            covered = Covered(
                reader.path.name, manifest.counts.get(JOURNAL_POSITION), manifest.journal_id
            )
            replayed = replay(state, read, covered, weight_version, accept_loss=accept_loss)
            log_damage(self.run_id, replayed)
            self._resume_at = max(replayed.last_id, read.highest_id) + 1
            self._restart = None
            self._resumes_journal = manifest.journal_id or read.journal_id or new_journal_id()
            self._damaged = {stop.segment for stop in read.stops}
            state.journal = self
            self.replayed = replayed
            return replayed

        return bring_forward

    def resume(self) -> None:
        """The restore succeeded: what it did not apply after accepting a loss is set aside,
        and the run goes on in a new segment above everything the folder holds, its first
        record the restore's restart; returns once that record is durable."""
        if self._resume_at is None:
            raise InvalidInput(f"run {self.run_id}: no restore to resume the journal after")
        first_id, restart = self._resume_at, self._restart
        self._resume_at = self._restart = None
        self.journal_id = self._resumes_journal
        replayed = self.replayed
        if replayed is not None and replayed.set_aside:
            set_aside(self.directory, replayed.set_aside)
        self._open(first_id)
        if restart is not None:
            if replayed is not None and replayed.accepted_loss:
                restart = {**restart, "accepted_loss": list(replayed.accepted_loss)}
            self.wait_durable(self.append(RecordKind.RESTART, restart))

    def abandon_restore(self) -> None:
        """The restore failed: nothing of it was written; a live run goes on appending where
        it was."""
        self._resume_at = self._restart = None

    def compact(self, store: SnapshotStore) -> int:
        """After a publish: go on in a new segment, delete the segments every retained
        snapshot covers (and their copies). Returns how many were deleted."""
        with self._segments_lock:
            self._open_writer().rotate()
            self._upload_closed()
            covered = _oldest_position(store)
            if covered is None:
                return 0
            deleted: list[str] = []
            for (_, path), (next_first, _) in itertools.pairwise(self._segments()):
                if next_first - 1 > covered:
                    break
                if path in self._damaged:  # its unread bytes stay for whoever looks
                    set_aside(self.directory, [path])
                else:
                    path.unlink(missing_ok=True)
                deleted.append(path.name)
            if self._mirror is not None and deleted:
                self._mirror.remove(deleted)
                self._mirrored.difference_update(deleted)
            return len(deleted)

    def mirror_now(self) -> int:
        """Close the open segment if it holds records the mirror has not seen, and copy every
        closed segment not copied yet; returns how many were. Nothing without a mirror."""
        with self._segments_lock:
            if self._mirror is None or self._writer is None or self._resume_at is not None:
                return 0
            if self._writer.holds_records:
                self._writer.rotate()
            return self._upload_closed()

    def close(self) -> None:
        self._stop.set()
        if self._mirror_thread is not None:
            self._mirror_thread.join()
        with self._segments_lock:
            self._close_writer()

    def _close_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # ---- helpers ----------------------------------------------------------------------------

    def _open(self, first_id: int) -> None:
        with self._segments_lock:
            self._close_writer()
            assert self.journal_id is not None  # started or restored first
            self._writer = JournalWriter(
                self.directory,
                self.run_id,
                first_id,
                self.journal_id,
                flush_ms=self.flush_ms,
                fsync=self._fsync,
            )

    def _upload_closed(self) -> int:
        """Copy every closed segment (all but the open one) not copied yet."""
        if self._mirror is None:
            return 0
        closed = [path for _, path in self._segments()[:-1] if path.name not in self._mirrored]
        for path in closed:
            self._mirror.upload(path)
            self._mirrored.add(path.name)
        return len(closed)

    def _fetch_missing(self) -> bool:
        """A restore on a host without the journal (the machine was lost): the segments the
        mirror holds and this folder lacks, downloaded first. Whether the folder had its own
        ``HEAD`` before (False: the mirror's copies are all there is, and the open segment of
        the lost host is the loss docs/journal.md describes)."""
        head_local = (self.directory / HEAD_NAME).exists()
        if self._mirror is None:
            return True
        self.directory.mkdir(parents=True, exist_ok=True)
        here = {path.name for _, path in self._segments()}
        aside = self.directory / SET_ASIDE_DIR
        here |= set(os.listdir(aside)) if aside.is_dir() else set()  # never read again
        for name in self._mirror.names():
            if segment_id(name) is not None and name not in here:
                self._mirror.fetch(name, self.directory)
            self._mirrored.add(name)
        return head_local

    def _mirror_loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.mirror_now()
            except Exception as exc:  # logged; the next round tries again
                log.warning(
                    "run %s: journal mirror failed (%s: %s); retried in %g s",
                    self.run_id,
                    type(exc).__name__,
                    exc,
                    every_s,
                )

    def _segments(self) -> list[tuple[int, Path]]:
        """Every segment with its first record id (from its name), in order."""
        if not self.directory.is_dir():
            return []
        return list_segments(self.directory)[0]

    def _next_start(self) -> tuple[int, str]:
        """Where a run that starts goes on, and in which journal: above every segment and
        record the folder holds (reads the newest segment only), in the journal its newest
        segment belongs to (a new one for a folder without, or an earlier rollsafe's)."""
        segments = self._segments()
        if not segments:
            return 1, new_journal_id()
        first_id, path = segments[-1]
        try:
            head = read_head(self.directory)
        except JournalCorrupt:
            head = None  # replaced by the new segment's; the run starts over anyway
        try:
            data = read_regular(path)
            header = decode_header(data, str(path))
        except (OSError, JournalCorrupt):
            return max(first_id, head.newest if head else 0) + 1, new_journal_id()
        records = decode_records(data, header, str(path)).records
        after = max(first_id + 1, first_id + len(records), (head.newest + 1) if head else 0)
        return after, header.journal_id or new_journal_id()


def restore_target(
    journal: RunJournal | None,
    weight_versions: Sequence[int] | None,
    *,
    accept_loss: bool = False,
) -> tuple[Accept | None, ReplayJournal | None]:
    """Which snapshots a restore may use, and the journal replay after it. Without a journal
    only a snapshot at a weight version the trainer holds (``weight_versions``) will do; with
    it, any snapshot at or below the newest of them, brought forward by the journal with the
    steps past those weights rolled back (call :meth:`RunJournal.resume` once restored).
    ``accept_loss``: RestoreRequest's ``accept_journal_loss``."""
    if journal is None:
        return accept_weight_versions(weight_versions), None
    target = max(weight_versions) if weight_versions else None
    return accept_at_or_below(target), journal.replayer(target, accept_loss=accept_loss)


def _oldest_position(store: SnapshotStore) -> int | None:
    """The lowest journal position among the published snapshots retention keeps (None: none
    of them names one)."""
    positions = [m.counts.get(JOURNAL_POSITION) for m in store.published_manifests()]
    known = [p for p in positions if p is not None]
    return min(known) if known else None


def set_aside(directory: Path, paths: Sequence[Path]) -> None:
    """Move each of ``paths`` (files of the journal's folder) into its ``set-aside/`` folder,
    whole and under its own name (a later one of the same name gets a suffix): nothing a
    restore could not use is deleted or overwritten, and no later restore reads it again."""
    aside = directory / SET_ASIDE_DIR
    aside.mkdir(exist_ok=True)
    for path in paths:
        target, n = aside / path.name, 1
        while os.path.lexists(target):
            target, n = aside / f"{path.name}.{n}", n + 1
        os.rename(path, target)
    fsync_dir(aside)
    fsync_dir(directory)


def log_damage(run_id: str, replayed: Replayed) -> None:
    """A WARNING for every stop the reading found and every loss the restore accepted."""
    for stop in replayed.stops:
        log.warning(
            "run %s: journal %s%s",
            run_id,
            stop.describe(),
            "; an earlier restore went on after it" if stop.superseded else "",
            extra={"run_id": run_id, "segment": stop.segment.name, "record": stop.stop.record},
        )
    for problem in replayed.accepted_loss:
        log.warning("run %s: journal loss accepted: %s", run_id, problem, extra={"run_id": run_id})
