"""Journal segments: group commit (one sync per batch), durable appends, reading across
segments, and what a reader refuses."""

from __future__ import annotations

import errno
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from rollsafe.errors import InvalidInput, JournalCorrupt, JournalFailed, JournalGap
from rollsafe.journal.format import RecordKind, encode_header
from rollsafe.journal.segments import JournalWriter, read_journal, segment_name

RUN = "seg-run"
JOURNAL = "ab" * 16


class CountingSync:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, descriptor: int) -> None:
        self.calls += 1


def test_a_batch_is_one_sync_and_every_record_reads_back_in_order(tmp_path: Path) -> None:
    sync = CountingSync()
    writer = JournalWriter(tmp_path, RUN, 0, JOURNAL, flush_ms=None, fsync=sync)
    after_create = sync.calls  # the header and the folder
    ids = [writer.append(RecordKind.HANDOUT, {"groups": [n]}) for n in range(100)]
    assert read_journal(tmp_path, RUN).records == []  # buffered: nothing written yet
    writer.flush()
    assert (sync.calls - after_create, writer.flushes) == (1, 1)
    read = read_journal(tmp_path, RUN)
    assert read.stop is None and [r.id for r in read.records] == ids == list(range(100))
    writer.close()


def test_append_durable_returns_once_its_batch_is_written(tmp_path: Path) -> None:
    writer = JournalWriter(tmp_path, RUN, 0, JOURNAL, flush_ms=1.0)
    row = {"tokens": np.arange(3, dtype=np.int32)}
    done: list[int] = []
    threads = [
        threading.Thread(
            target=lambda n=n: done.append(
                writer.append_durable(RecordKind.SEAL, {"group": n}, row)
            )
        )
        for n in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    # Each returned only when durable: every id it got is on disk now, before close().
    on_disk = {r.id for r in read_journal(tmp_path, RUN).records}
    assert sorted(done) == list(range(8)) and set(done) <= on_disk
    writer.close()
    assert writer.flushes <= 8


def test_segments_read_in_order_and_a_gap_between_them_is_a_problem(tmp_path: Path) -> None:
    first = JournalWriter(tmp_path, RUN, 0, JOURNAL, flush_ms=None)
    first.append(RecordKind.HANDOUT, {"groups": [0]})
    first.close()
    second = JournalWriter(tmp_path, RUN, 1, JOURNAL, flush_ms=None)
    second.append(RecordKind.EVICT, {"groups": [0]})
    second.close()
    read = read_journal(tmp_path, RUN)
    assert [r.id for r in read.records] == [0, 1] and read.problems == []
    (tmp_path / segment_name(5)).write_bytes((tmp_path / segment_name(1)).read_bytes())
    read = read_journal(tmp_path, RUN)
    assert [r.id for r in read.records] == [0, 1]  # up to the problem, nothing after it
    assert read.unusable == [tmp_path / segment_name(5)]
    with pytest.raises(JournalGap, match="its header says it starts at record 1"):
        read.refuse_problems()


def test_a_segment_of_another_run_or_journal_is_a_problem_named(tmp_path: Path) -> None:
    JournalWriter(tmp_path, "other-run", 0, JOURNAL, flush_ms=None).close()
    assert read_journal(tmp_path, RUN).problems == [
        f"{tmp_path / segment_name(0)}: a segment of run 'other-run', not 'seg-run'"
    ]
    other = tmp_path / "other"
    JournalWriter(other, RUN, 0, JOURNAL, flush_ms=None).close()
    JournalWriter(other, RUN, 1, "cd" * 16, flush_ms=None).close()
    problems = read_journal(other, RUN).problems
    assert f"a segment of journal {'cd' * 16}, not {JOURNAL}" in problems[0]


def test_a_torn_tail_stops_reading_and_changes_nothing(tmp_path: Path) -> None:
    writer = JournalWriter(tmp_path, RUN, 0, JOURNAL, flush_ms=None)
    for n in range(3):
        writer.append(RecordKind.CLAIM, {"groups": [n], "step": n})
    writer.close()
    path = tmp_path / segment_name(0)
    torn = path.read_bytes()[:-3]
    path.write_bytes(torn)
    read = read_journal(tmp_path, RUN)
    assert [r.id for r in read.records] == [0, 1] and read.stop is not None
    assert (read.stop.reason, read.stop.record, read.stopped_in) == ("torn", 2, path)
    assert path.read_bytes() == torn


def test_a_closed_writer_and_any_existing_segment_are_refused(tmp_path: Path) -> None:
    writer = JournalWriter(tmp_path, RUN, 0, JOURNAL, flush_ms=None)
    writer.append(RecordKind.HANDOUT, {"groups": [0]})
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(InvalidInput, match="closed"):
        writer.append(RecordKind.HANDOUT, {"groups": [1]})
    with pytest.raises(InvalidInput, match="exists: a segment is never replaced"):
        JournalWriter(tmp_path, RUN, 0, JOURNAL, flush_ms=None)
    assert [r.id for r in read_journal(tmp_path, RUN).records] == [0]


def test_a_segment_whose_first_record_is_damaged_is_never_replaced(tmp_path: Path) -> None:
    # Records 5-7, the first of them torn: nothing of the segment reads, all of it stays.
    writer = JournalWriter(tmp_path, RUN, 5, JOURNAL, flush_ms=None)
    for n in range(3):
        writer.append(RecordKind.HANDOUT, {"groups": [n]})
    writer.close()
    path = tmp_path / segment_name(5)
    data = bytearray(path.read_bytes())
    data[len(encode_header(RUN, 5, JOURNAL)) + 12] ^= 0xFF  # inside the first record
    path.write_bytes(bytes(data))
    read = read_journal(tmp_path, RUN)
    assert read.records == [] and read.stop is not None and read.stop.record == 5
    with pytest.raises(InvalidInput, match="never replaced"):
        JournalWriter(tmp_path, RUN, 5, JOURNAL, flush_ms=None)
    assert path.read_bytes() == bytes(data)
    # A restore goes on above everything the folder holds: the stop stays reported.
    restored = JournalWriter(tmp_path, RUN, read.highest_id + 1, JOURNAL, flush_ms=None)
    restored.append(RecordKind.RESTART, {"why": "restore"})
    restored.close()
    again = read_journal(tmp_path, RUN)
    assert [r.id for r in again.records] == [6] and again.stop is None
    assert [(s.stop.record, s.superseded) for s in again.stops] == [(5, True)]
    assert again.problems == [] and path.read_bytes() == bytes(data)


def test_rotate_goes_on_in_a_new_segment_at_the_next_id(tmp_path: Path) -> None:
    writer = JournalWriter(tmp_path, RUN, 1, JOURNAL, flush_ms=None)
    writer.append(RecordKind.HANDOUT, {"groups": [0]})
    writer.rotate()
    writer.append(RecordKind.HANDOUT, {"groups": [1]})
    writer.close()
    read = read_journal(tmp_path, RUN)
    assert [s.first_id for s in read.segments] == [1, 2]
    assert [r.id for r in read.records] == [1, 2] and read.problems == []


def test_after_a_stop_only_a_segment_a_restore_opened_may_follow(tmp_path: Path) -> None:
    first = JournalWriter(tmp_path, RUN, 1, JOURNAL, flush_ms=None)
    for n in range(3):
        first.append(RecordKind.HANDOUT, {"groups": [n]})
    first.close()
    path = tmp_path / segment_name(1)
    path.write_bytes(path.read_bytes()[:-3])  # record 3 torn by a crash
    later = JournalWriter(tmp_path, RUN, 3, JOURNAL, flush_ms=None)
    later.append(RecordKind.HANDOUT, {"groups": [9]})  # not a restore's first record
    later.close()
    with pytest.raises(JournalGap, match=r"torn record 3 at offset .* never skips"):
        read_journal(tmp_path, RUN).refuse_problems()
    (tmp_path / segment_name(3)).unlink()
    restored = JournalWriter(tmp_path, RUN, 7, JOURNAL, flush_ms=None)  # ids up to 6 covered
    restored.append(RecordKind.RESTART, {"why": "restore"})
    restored.close()
    read = read_journal(tmp_path, RUN)
    assert [r.id for r in read.records] == [1, 2, 7] and read.stop is None
    assert [(s.stop.record, s.superseded) for s in read.stops] == [(3, True)]


def test_the_newest_segment_missing_is_named_by_head(tmp_path: Path) -> None:
    writer = JournalWriter(tmp_path, RUN, 1, JOURNAL, flush_ms=None)
    writer.append(RecordKind.HANDOUT, {"groups": [0]})
    writer.rotate()
    writer.append(RecordKind.HANDOUT, {"groups": [1]})
    writer.close()
    (tmp_path / segment_name(2)).unlink()
    read = read_journal(tmp_path, RUN)
    assert [r.id for r in read.records] == [1]
    assert read.problems == [
        f"{tmp_path / segment_name(2)}: missing: the newest segment (named by HEAD)"
    ]
    (tmp_path / "HEAD").unlink()
    assert "HEAD: missing" in read_journal(tmp_path, RUN).problems[0]


@pytest.mark.parametrize("what", ["a directory", "a FIFO", "a symbolic link"])
def test_something_named_like_a_segment_that_is_no_file_is_a_problem_never_read(
    tmp_path: Path, what: str
) -> None:
    JournalWriter(tmp_path, RUN, 1, JOURNAL, flush_ms=None).close()
    odd = tmp_path / segment_name(2)
    if what == "a directory":
        odd.mkdir()
    elif what == "a FIFO":
        os.mkfifo(odd)  # a plain read would block for ever
    else:
        odd.symlink_to("/dev/zero")  # a plain read would never end
    read = read_journal(tmp_path, RUN)
    assert read.unusable == [odd] and str(odd) in read.problems[0]
    assert ("symbolic link" if what == "a symbolic link" else what) in read.problems[0]


def test_a_journal_folder_that_is_a_file_is_refused_by_name(tmp_path: Path) -> None:
    place = tmp_path / "journal"
    place.write_bytes(b"not a folder")
    with pytest.raises(JournalCorrupt, match="journal's place holds something not a folder"):
        read_journal(place, RUN)


class FullDisk:
    """An fsync that fails once ``full`` is set, as a disk out of space fails it."""

    def __init__(self) -> None:
        self.full = threading.Event()

    def __call__(self, descriptor: int) -> None:
        if self.full.is_set():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_fails_the_waiters_and_every_later_append_by_name(tmp_path: Path) -> None:
    """The flusher's failed sync fails its batch's waiters at once (not a hang: the flusher
    used to die with the batch taken) and every later append, naming the segment and the
    disk's error; close does not hide it and still closes the file."""
    disk = FullDisk()
    writer = JournalWriter(tmp_path, RUN, 0, JOURNAL, flush_ms=1.0, fsync=disk)
    writer.append_durable(RecordKind.HANDOUT, {"groups": [0]})
    disk.full.set()
    lost = writer.append(RecordKind.HANDOUT, {"groups": [1]})
    with pytest.raises(JournalFailed, match=r"writing records 1-1 failed \(No space left"):
        writer.wait_durable(lost)
    with pytest.raises(JournalFailed, match=re.escape(str(writer.path))):
        writer.append(RecordKind.HANDOUT, {"groups": [2]})
    with pytest.raises(JournalFailed, match="No space left"):
        writer.append_durable(RecordKind.HANDOUT, {"groups": [3]})
    writer.close()
    # The durable record is there; the failed batch's reached the file here (only its sync
    # failed): whatever a restore then reads is the truth, as the error says.
    assert [r.id for r in read_journal(tmp_path, RUN).records][:1] == [0]


def test_a_sync_that_stalls_fails_its_waiter_within_the_bound(tmp_path: Path) -> None:
    stalled, release = threading.Event(), threading.Event()

    def stalling(descriptor: int) -> None:
        if stalled.is_set():
            release.wait(timeout=60)

    writer = JournalWriter(tmp_path, RUN, 0, JOURNAL, flush_ms=1.0, fsync=stalling)
    stalled.set()
    record = writer.append(RecordKind.HANDOUT, {"groups": [0]})
    try:
        with pytest.raises(JournalFailed, match=r"record 0 not durable within 0\.2 s"):
            writer.wait_durable(record, timeout_s=0.2)
    finally:
        release.set()
        writer.close()
