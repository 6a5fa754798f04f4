"""The journal's format: records round-trip, and reading stops (never skips) at the first torn or
corrupt record, saying where and why; a header that is not this format's is refused by name."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable

import numpy as np
import pytest

from rollsafe.errors import InvalidInput, JournalCorrupt
from rollsafe.journal.format import (
    Record,
    RecordKind,
    decode_header,
    decode_records,
    encode_header,
    encode_record,
)

RUN = "journal-run"
JOURNAL = "5e" * 16
ROW = {
    "tokens": np.arange(7, dtype=np.int32),
    "logprobs": np.linspace(-1, 0, 7, dtype=np.float32),
    "reward": np.array(0.5, np.float32),
}


def records(first: int = 10) -> list[Record]:
    return [
        Record(first, RecordKind.HANDOUT, {"groups": [0, 1]}),
        Record(first + 1, RecordKind.DISPATCH, {"group": 0, "sibling": 1, "owner": "w0"}),
        Record(first + 2, RecordKind.SEAL, {"group": 0, "sibling": 1, "attempt": 0}, ROW),
        Record(first + 3, RecordKind.CLAIM, {"groups": [0], "step": 0}),
    ]


def segment(first: int = 10) -> tuple[bytes, list[int]]:
    """A segment's bytes and where each record's frame starts."""
    data, starts = encode_header(RUN, first, JOURNAL), []
    for record in records(first):
        starts.append(len(data))
        data += encode_record(record)
    return data, starts


def test_records_round_trip_rows_included() -> None:
    data, _ = segment()
    header = decode_header(data, "seg")
    assert (header.run_id, header.first_id, header.journal_id) == (RUN, 10, JOURNAL)
    decoded = decode_records(data, header, "seg")
    assert decoded.stop is None and decoded.end == len(data)
    assert [(r.id, r.kind, r.meta) for r in decoded.records] == [
        (r.id, r.kind, r.meta) for r in records()
    ]
    row = decoded.records[2].row
    assert row is not None and sorted(row) == sorted(ROW)
    for name, array in ROW.items():
        assert row[name].dtype == array.dtype and row[name].shape == array.shape
        assert row[name].tobytes() == array.tobytes()


def test_a_torn_last_record_stops_reading_at_its_start_wherever_it_was_cut() -> None:
    data, starts = segment()
    header = decode_header(data, "seg")
    for cut in range(starts[-1] + 1, len(data)):
        decoded = decode_records(data[:cut], header, "seg")
        assert decoded.stop is not None and decoded.stop.reason == "torn", cut
        assert decoded.stop.offset == starts[-1] and decoded.end == starts[-1]
        assert [r.id for r in decoded.records] == [10, 11, 12]


@pytest.mark.parametrize("record", [0, 1, 2])
def test_a_flipped_byte_stops_reading_at_that_record_and_nothing_after_is_applied(
    record: int,
) -> None:
    data, starts = segment()
    header = decode_header(data, "seg")
    flipped = bytearray(data)
    flipped[starts[record] + 12] ^= 0x40  # inside the body: the checksum no longer matches
    decoded = decode_records(bytes(flipped), header, "seg")
    assert decoded.stop is not None
    assert (decoded.stop.reason, decoded.stop.offset) == ("corrupt", starts[record])
    assert [r.id for r in decoded.records] == [10, 11, 12][:record]


def test_a_record_out_of_sequence_is_corrupt() -> None:
    record = Record(6, RecordKind.EVICT, {"groups": [3]})
    data = encode_header(RUN, 5, JOURNAL) + encode_record(record)
    decoded = decode_records(data, decode_header(data, "seg"), "seg")
    assert decoded.stop is not None and "record id 6 where 5 is next" in decoded.stop.detail
    assert decoded.records == []


@pytest.mark.parametrize(
    ("mangle", "named"),
    [
        (lambda d: b"NOTJOURN" + d[8:], "not a rollsafe journal segment"),
        (lambda d: d[:8] + b"\x09\x00" + d[10:], "format version 9"),
        (lambda d: d[:12] + b"X" + d[13:], "header checksum does not match"),
        (lambda d: d[:10], "too short"),
        (lambda d: d[:8] + b"\x03\x00" + d[10:], r"format version 3; this rollsafe reads \(1, 2\)"),
    ],
)
def test_a_header_that_is_not_this_formats_is_refused_by_name(
    mangle: Callable[[bytes], bytes], named: str
) -> None:
    data, _ = segment()
    with pytest.raises(JournalCorrupt, match=named):
        decode_header(mangle(data), "seg-1")


def test_what_cannot_be_written_is_refused_before_anything_is() -> None:
    with pytest.raises(InvalidInput, match="not JSON"):
        encode_record(Record(0, RecordKind.CLAIM, {"groups": {1, 2}}))
    with pytest.raises(InvalidInput, match="a row goes with a seal"):
        encode_record(Record(0, RecordKind.SEAL, {"group": 0}))
    with pytest.raises(InvalidInput, match="a row goes with a seal"):
        encode_record(Record(0, RecordKind.CLAIM, {"groups": [0]}, ROW))
    with pytest.raises(InvalidInput, match="run id"):
        encode_header("bad run id!", 0, JOURNAL)


def test_an_earlier_rollsafes_header_without_a_journal_id_is_still_read() -> None:
    name = RUN.encode()
    head = struct.pack("<8sHH", b"RSJOURNL", 1, len(name)) + name + struct.pack("<Q", 10)
    data = head + struct.pack("<I", zlib.crc32(head))
    for record in records(10):
        data += encode_record(record)
    header = decode_header(data, "v1")
    assert (header.run_id, header.first_id, header.journal_id) == (RUN, 10, None)
    assert [r.id for r in decode_records(data, header, "v1").records] == [10, 11, 12, 13]


def test_a_run_id_that_is_not_utf8_is_refused_by_name_not_a_decode_error() -> None:
    name = b"\xff\xfe-run"
    head = struct.pack("<8sHH", b"RSJOURNL", 2, len(name)) + name + bytes(16)
    head += struct.pack("<Q", 1)
    with pytest.raises(JournalCorrupt, match="seg-9: the header's run id is not UTF-8"):
        decode_header(head + struct.pack("<I", zlib.crc32(head)), "seg-9")


def test_metadata_nested_thousands_deep_is_a_stop_not_a_recursion_error() -> None:
    deep = b"[" * 5000 + b"]" * 5000
    body = struct.pack("<QBI", 10, int(RecordKind.HANDOUT), len(deep)) + deep
    data = encode_header(RUN, 10, JOURNAL) + struct.pack("<II", len(body), zlib.crc32(body))
    decoded = decode_records(data + body, decode_header(data, "seg"), "seg")
    assert decoded.stop is not None and decoded.stop.reason == "corrupt"
    assert "recursion limit" in decoded.stop.detail and decoded.stop.record == 10
