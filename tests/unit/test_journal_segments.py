"""Journal segments: group commit (one sync per batch), durable appends, reading across
segments, and what a reader refuses."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from rollsafe.errors import InvalidInput, JournalCorrupt
from rollsafe.journal.format import RecordKind
from rollsafe.journal.segments import JournalWriter, read_journal, segment_name

RUN = "seg-run"


class CountingSync:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, descriptor: int) -> None:
        self.calls += 1


def test_a_batch_is_one_sync_and_every_record_reads_back_in_order(tmp_path: Path) -> None:
    sync = CountingSync()
    writer = JournalWriter(tmp_path, RUN, 0, flush_ms=None, fsync=sync)
    after_create = sync.calls  # the header and the folder
    ids = [writer.append(RecordKind.HANDOUT, {"groups": [n]}) for n in range(100)]
    assert read_journal(tmp_path, RUN).records == []  # buffered: nothing written yet
    writer.flush()
    assert (sync.calls - after_create, writer.flushes) == (1, 1)
    read = read_journal(tmp_path, RUN)
    assert read.stop is None and [r.id for r in read.records] == ids == list(range(100))
    writer.close()


def test_append_durable_returns_once_its_batch_is_written(tmp_path: Path) -> None:
    writer = JournalWriter(tmp_path, RUN, 0, flush_ms=1.0)
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


def test_segments_read_in_order_and_a_gap_between_them_is_refused(tmp_path: Path) -> None:
    first = JournalWriter(tmp_path, RUN, 0, flush_ms=None)
    first.append(RecordKind.HANDOUT, {"groups": [0]})
    first.close()
    second = JournalWriter(tmp_path, RUN, 1, flush_ms=None)
    second.append(RecordKind.EVICT, {"groups": [0]})
    second.close()
    assert [r.id for r in read_journal(tmp_path, RUN).records] == [0, 1]
    (tmp_path / segment_name(5)).write_bytes((tmp_path / segment_name(1)).read_bytes())
    with pytest.raises(JournalCorrupt, match="starts at record 1, the segment before it ends"):
        read_journal(tmp_path, RUN)


def test_a_segment_of_another_run_is_refused_by_name(tmp_path: Path) -> None:
    JournalWriter(tmp_path, "other-run", 0, flush_ms=None).close()
    with pytest.raises(JournalCorrupt, match="a segment of run 'other-run', not 'seg-run'"):
        read_journal(tmp_path, RUN)


def test_a_torn_tail_stops_reading_and_changes_nothing(tmp_path: Path) -> None:
    writer = JournalWriter(tmp_path, RUN, 0, flush_ms=None)
    for n in range(3):
        writer.append(RecordKind.CLAIM, {"groups": [n], "step": n})
    writer.close()
    path = tmp_path / segment_name(0)
    torn = path.read_bytes()[:-3]
    path.write_bytes(torn)
    read = read_journal(tmp_path, RUN)
    assert [r.id for r in read.records] == [0, 1] and read.stop is not None
    assert (read.stop.reason, read.stopped_in) == ("torn", path)
    assert path.read_bytes() == torn


def test_a_closed_writer_and_a_segment_with_records_are_refused(tmp_path: Path) -> None:
    writer = JournalWriter(tmp_path, RUN, 0, flush_ms=None)
    writer.append(RecordKind.HANDOUT, {"groups": [0]})
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(InvalidInput, match="closed"):
        writer.append(RecordKind.HANDOUT, {"groups": [1]})
    with pytest.raises(InvalidInput, match="exists"):
        JournalWriter(tmp_path, RUN, 0, flush_ms=None)
    assert [r.id for r in read_journal(tmp_path, RUN).records] == [0]


def test_a_segment_holding_no_whole_record_is_replaced(tmp_path: Path) -> None:
    # A restore opened it and crashed before its first record was durable.
    JournalWriter(tmp_path, RUN, 5, flush_ms=None).close()
    (tmp_path / segment_name(5)).open("ab").write(b"\x07\x00")  # a torn frame
    writer = JournalWriter(tmp_path, RUN, 5, flush_ms=None)
    writer.append(RecordKind.RESTART, {"why": "restore"})
    writer.close()
    read = read_journal(tmp_path, RUN)
    assert ([r.id for r in read.records], read.stop) == ([5], None)


def test_rotate_goes_on_in_a_new_segment_at_the_next_id(tmp_path: Path) -> None:
    writer = JournalWriter(tmp_path, RUN, 1, flush_ms=None)
    writer.append(RecordKind.HANDOUT, {"groups": [0]})
    writer.rotate()
    writer.append(RecordKind.HANDOUT, {"groups": [1]})
    writer.close()
    read = read_journal(tmp_path, RUN)
    assert [s.first_id for s in read.segments] == [1, 2]
    assert [r.id for r in read.records] == [1, 2]


def test_after_a_stop_only_a_segment_a_restore_opened_may_follow(tmp_path: Path) -> None:
    first = JournalWriter(tmp_path, RUN, 1, flush_ms=None)
    for n in range(3):
        first.append(RecordKind.HANDOUT, {"groups": [n]})
    first.close()
    path = tmp_path / segment_name(1)
    path.write_bytes(path.read_bytes()[:-3])  # record 3 torn by a crash
    later = JournalWriter(tmp_path, RUN, 3, flush_ms=None)
    later.append(RecordKind.HANDOUT, {"groups": [9]})  # not a restore's first record
    later.close()
    with pytest.raises(JournalCorrupt, match=r"torn record at offset .* never skips"):
        read_journal(tmp_path, RUN)
    (tmp_path / segment_name(3)).unlink()
    restored = JournalWriter(tmp_path, RUN, 7, flush_ms=None)  # ids up to 6 a snapshot covered
    restored.append(RecordKind.RESTART, {"why": "restore"})
    restored.close()
    read = read_journal(tmp_path, RUN)
    assert [r.id for r in read.records] == [1, 2, 7] and read.stop is None
