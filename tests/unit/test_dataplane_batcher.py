"""ReadBatcher: concurrent reads share one get, and a failed batch costs N+1 reads, not more."""

from __future__ import annotations

import asyncio
import builtins
import math
import threading
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from rollsafe.dataplane.batcher import BatcherStats, ReadBatcher
from rollsafe.dataplane.memory import MemoryDataPlane
from rollsafe.dataplane.protocol import DataPlaneManifest, Row
from rollsafe.errors import DataPlaneKeyMissing, DataPlaneUnavailable, InvalidInput
from rollsafe.testing.waiting import eventually_async

PART = "prefixes"
WINDOW = 0.005  # short, so every test runs in milliseconds


def key(i: int) -> str:
    return f"prefix/call-{i}"


def row(i: int) -> dict[str, np.ndarray]:
    return {"tokens": np.arange(i, i + 5, dtype=np.int64), "score": np.array(i / 4, np.float32)}


class CountingPlane:
    """A real MemoryDataPlane behind a get that records every call and fails on request."""

    name = "counting"

    def __init__(self, count: int = 0) -> None:
        self.inner = MemoryDataPlane()
        if count:
            self.inner.put(PART, {key(i): row(i) for i in range(count)})
        self.calls: list[list[str]] = []
        self.outage = False  # every read raises DataPlaneUnavailable
        self.fail_batches = False  # reads of more than one key raise DataPlaneUnavailable
        self.fail_keys: dict[str, type[Exception]] = {}  # any read naming the key raises this
        self.gate: threading.Event | None = None  # when set up, the first read waits on it
        self.entered = threading.Event()

    def put(self, partition: str, rows: Mapping[str, Row]) -> None:
        self.inner.put(partition, rows)

    def get(self, partition: str, keys: Iterable[str]) -> dict[str, dict[str, np.ndarray]]:
        wanted = list(keys)
        self.calls.append(wanted)
        first = len(self.calls) == 1
        self.entered.set()
        if first and self.gate is not None:
            assert self.gate.wait(5), "the test never released the first read"
        if self.outage:
            raise DataPlaneUnavailable(f"outage reading {wanted}")
        if self.fail_batches and len(wanted) > 1:
            raise DataPlaneUnavailable(f"batch of {len(wanted)} failed")
        failing = [k for k in wanted if k in self.fail_keys]
        if failing:
            if self.fail_keys[failing[0]] is DataPlaneKeyMissing:
                raise DataPlaneKeyMissing(partition, failing)
            raise DataPlaneUnavailable(f"cannot read {', '.join(failing)}")
        return self.inner.get(partition, wanted)

    def sizes(self) -> list[int]:
        return [len(call) for call in self.calls]

    # The rest of the DataPlane protocol, passed straight to the inner plane.

    def list(self, partition: str) -> builtins.list[str]:
        return self.inner.list(partition)

    def count(self, partition: str) -> int:
        return self.inner.count(partition)

    def delete(self, partition: str, keys: Iterable[str]) -> None:
        self.inner.delete(partition, keys)

    def clear(self, partition: str | None = None) -> None:
        self.inner.clear(partition)

    def partitions(self) -> builtins.list[str]:
        return self.inner.partitions()

    def export(
        self, directory: Path, keys: Mapping[str, Collection[str]] | None = None
    ) -> DataPlaneManifest:
        return self.inner.export(directory, keys)

    def import_(self, directory: Path, manifest: DataPlaneManifest) -> None:
        self.inner.import_(directory, manifest)


def assert_row(got: object, i: int) -> None:
    assert isinstance(got, dict), got
    expected = row(i)
    assert got.keys() == expected.keys()
    for field, array in expected.items():
        assert got[field].dtype == array.dtype
        np.testing.assert_array_equal(got[field], array)


async def read_all(
    batcher: ReadBatcher, keys: Iterable[str]
) -> list[dict[str, np.ndarray] | BaseException]:
    return await asyncio.gather(*(batcher.read(k) for k in keys), return_exceptions=True)


def stats(reads: int, batches: int, fallback_reads: int, rows: int) -> BatcherStats:
    return BatcherStats(reads=reads, batches=batches, fallback_reads=fallback_reads, rows=rows)


# -- coalescing ---------------------------------------------------------------------------------


async def test_concurrent_reads_coalesce_into_one_get() -> None:
    plane = CountingPlane(100)
    batcher = ReadBatcher(plane, PART, window_s=WINDOW)
    results = await read_all(batcher, [key(i) for i in range(100)])
    assert plane.calls == [[key(i) for i in range(100)]]
    for i, got in enumerate(results):
        assert_row(got, i)
    assert batcher.stats == stats(reads=1, batches=1, fallback_reads=0, rows=100)


async def test_full_windows_split_at_max_rows() -> None:
    plane = CountingPlane(600)
    batcher = ReadBatcher(plane, PART, window_s=WINDOW, max_rows=256)
    results = await read_all(batcher, [key(i) for i in range(600)])
    assert sorted(plane.sizes()) == [88, 256, 256]
    read = [k for call in plane.calls for k in call]
    assert sorted(read) == sorted(key(i) for i in range(600))  # each key in exactly one batch
    for i, got in enumerate(results):
        assert_row(got, i)
    assert batcher.stats == stats(reads=3, batches=3, fallback_reads=0, rows=600)


async def test_full_window_does_not_wait_for_the_timer() -> None:
    plane = CountingPlane(4)
    batcher = ReadBatcher(plane, PART, window_s=60.0, max_rows=4)
    results = await asyncio.wait_for(read_all(batcher, [key(i) for i in range(4)]), 2.0)
    assert plane.sizes() == [4]
    for i, got in enumerate(results):
        assert_row(got, i)


async def test_reads_within_the_window_join_the_open_batch() -> None:
    plane = CountingPlane(2)
    batcher = ReadBatcher(plane, PART, window_s=10 * WINDOW)
    first = asyncio.create_task(batcher.read(key(0)))
    await asyncio.sleep(WINDOW / 5)  # later than the first read, well inside its window
    second = asyncio.create_task(batcher.read(key(1)))
    assert_row(await first, 0)
    assert_row(await second, 1)
    assert plane.calls == [[key(0), key(1)]]


async def test_reads_further_apart_than_the_window_are_separate_batches() -> None:
    plane = CountingPlane(3)
    batcher = ReadBatcher(plane, PART, window_s=WINDOW)
    first = asyncio.create_task(batcher.read(key(0)))
    # The first window closed (its batch went to the plane) before the next reads are made.
    await eventually_async(lambda: plane.calls, what="the first window's read")
    rest = await read_all(batcher, [key(1), key(2)])
    assert_row(await first, 0)
    assert_row(rest[0], 1)
    assert_row(rest[1], 2)
    assert plane.calls == [[key(0)], [key(1), key(2)]]
    assert batcher.stats == stats(reads=2, batches=1, fallback_reads=0, rows=3)


async def test_duplicate_keys_are_read_once_and_every_caller_gets_the_row() -> None:
    plane = CountingPlane(2)
    batcher = ReadBatcher(plane, PART, window_s=WINDOW)
    results = await read_all(batcher, [key(0), key(0), key(1), key(0)])
    assert plane.calls == [[key(0), key(1)]]
    for i, got in zip([0, 0, 1, 0], results, strict=True):
        assert_row(got, i)
    assert results[0] is not results[1]  # one caller's dict is never another's
    assert batcher.stats == stats(reads=1, batches=1, fallback_reads=0, rows=4)


async def test_reads_keep_collecting_while_a_batch_is_in_flight() -> None:
    plane = CountingPlane(6)
    plane.gate = threading.Event()
    batcher = ReadBatcher(plane, PART, window_s=WINDOW)
    try:
        first = asyncio.create_task(batcher.read(key(0)))
        assert await asyncio.to_thread(plane.entered.wait, 2.0)
        # The first get is blocked in its thread; the loop must still serve a second batch.
        rest = await asyncio.wait_for(read_all(batcher, [key(i) for i in range(1, 6)]), 2.0)
        assert not first.done()
    finally:
        plane.gate.set()
    assert_row(await first, 0)
    for i, got in enumerate(rest, start=1):
        assert_row(got, i)
    assert plane.calls == [[key(0)], [key(i) for i in range(1, 6)]]


# -- failures -----------------------------------------------------------------------------------


async def test_outage_costs_n_plus_one_reads_and_every_caller_gets_an_error() -> None:
    plane = CountingPlane(20)
    plane.outage = True
    batcher = ReadBatcher(plane, PART, window_s=WINDOW)
    keys = [key(i) for i in range(20)]
    results = await read_all(batcher, keys)
    assert plane.sizes() == [20] + [1] * 20
    assert plane.calls[0] == keys
    assert sorted(plane.calls[1:]) == sorted([k] for k in keys)  # each key alone, once
    for k, got in zip(keys, results, strict=True):
        assert isinstance(got, DataPlaneUnavailable)
        assert str(got) == f"outage reading {[k]}"  # its own single read's error
    assert batcher.stats == stats(reads=21, batches=1, fallback_reads=20, rows=0)


async def test_failed_batch_gives_each_caller_its_own_row_or_its_own_error() -> None:
    plane = CountingPlane(10)
    plane.fail_keys = {key(3): DataPlaneKeyMissing, key(7): DataPlaneUnavailable}
    batcher = ReadBatcher(plane, PART, window_s=WINDOW)
    results = await read_all(batcher, [key(i) for i in range(10)])
    assert plane.sizes() == [10] + [1] * 10
    for i, got in enumerate(results):
        if i == 3:
            assert isinstance(got, DataPlaneKeyMissing)
            assert got.missing == [key(3)]
        elif i == 7:
            assert isinstance(got, DataPlaneUnavailable)
            assert str(got) == f"cannot read {key(7)}"
        else:
            assert_row(got, i)
    assert batcher.stats == stats(reads=11, batches=1, fallback_reads=10, rows=8)


async def test_missing_key_in_the_memory_plane_fails_only_its_caller() -> None:
    plane = CountingPlane(5)
    batcher = ReadBatcher(plane, PART, window_s=WINDOW)
    keys = [key(0), key(1), "prefix/never-staged", key(2), key(3), key(4)]
    results = await read_all(batcher, keys)
    assert plane.sizes() == [6] + [1] * 6
    missing = results.pop(2)
    assert isinstance(missing, DataPlaneKeyMissing)
    assert missing.partition == PART
    assert missing.missing == ["prefix/never-staged"]
    for i, got in enumerate(results):
        assert_row(got, i)


async def test_single_key_batch_that_fails_is_not_read_again() -> None:
    plane = CountingPlane(1)
    plane.outage = True
    batcher = ReadBatcher(plane, PART, window_s=WINDOW)
    results = await read_all(batcher, [key(0), key(0)])  # one distinct key, two callers
    assert plane.calls == [[key(0)]]
    assert all(isinstance(got, DataPlaneUnavailable) for got in results)
    assert batcher.stats == stats(reads=1, batches=0, fallback_reads=0, rows=0)


# -- cancellation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fail_batches", "sizes"), [(False, [10]), (True, [10] + [1] * 10)], ids=["read", "fallback"]
)
async def test_caller_cancelled_before_the_read_does_not_disturb_the_others(
    fail_batches: bool, sizes: list[int]
) -> None:
    plane = CountingPlane(10)
    plane.fail_batches = fail_batches
    batcher = ReadBatcher(plane, PART, window_s=WINDOW)
    tasks = [asyncio.create_task(batcher.read(key(i))) for i in range(10)]
    await asyncio.sleep(0)  # every task has joined the window
    tasks[3].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[3], asyncio.CancelledError)
    for i, got in enumerate(results):
        if i != 3:
            assert_row(got, i)
    assert plane.sizes() == sizes
    assert batcher.stats.rows == 9


async def test_caller_cancelled_while_the_read_is_in_flight_does_not_disturb_the_others() -> None:
    plane = CountingPlane(3)
    plane.gate = threading.Event()
    batcher = ReadBatcher(plane, PART, window_s=WINDOW)
    try:
        tasks = [asyncio.create_task(batcher.read(k)) for k in (key(0), key(1), key(1), key(2))]
        assert await asyncio.to_thread(plane.entered.wait, 2.0)
        tasks[1].cancel()  # one of two callers of the same key
    finally:
        plane.gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[1], asyncio.CancelledError)
    assert_row(results[0], 0)
    assert_row(results[2], 1)
    assert_row(results[3], 2)
    assert plane.calls == [[key(0), key(1), key(2)]]


# -- arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize("window_s", [-0.001, math.nan, math.inf, -math.inf, "0.1", True])
def test_bad_window_raises_invalid_input(window_s: object) -> None:
    with pytest.raises(InvalidInput, match="window_s") as caught:
        ReadBatcher(CountingPlane(), PART, window_s=window_s)  # type: ignore[arg-type]
    assert repr(window_s) in str(caught.value)


@pytest.mark.parametrize("max_rows", [0, -5, 2.5, True])
def test_bad_max_rows_raises_invalid_input(max_rows: object) -> None:
    with pytest.raises(InvalidInput, match="max_rows") as caught:
        ReadBatcher(CountingPlane(), PART, max_rows=max_rows)  # type: ignore[arg-type]
    assert repr(max_rows) in str(caught.value)


@pytest.mark.parametrize("partition", ["", ".", "..", "a/b", "x" * 65, 7])
def test_bad_partition_raises_invalid_input(partition: object) -> None:
    with pytest.raises(InvalidInput, match="partition") as caught:
        ReadBatcher(CountingPlane(), partition)  # type: ignore[arg-type]
    assert repr(partition) in str(caught.value)


@pytest.mark.parametrize("bad_key", ["", None, 3, b"prefix/call-0"])
async def test_bad_key_raises_invalid_input_without_reading(bad_key: object) -> None:
    plane = CountingPlane(1)
    batcher = ReadBatcher(plane, PART, window_s=WINDOW)
    with pytest.raises(InvalidInput, match="key") as caught:
        await batcher.read(bad_key)  # type: ignore[arg-type]
    assert repr(bad_key) in str(caught.value)
    assert_row(await batcher.read(key(0)), 0)  # the batcher still works
    assert plane.calls == [[key(0)]]


def test_zero_window_is_allowed_and_stats_are_a_frozen_snapshot() -> None:
    batcher = ReadBatcher(CountingPlane(), PART, window_s=0, max_rows=1)
    snapshot = batcher.stats
    assert snapshot == stats(reads=0, batches=0, fallback_reads=0, rows=0)
    with pytest.raises(ValidationError):
        snapshot.reads = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        BatcherStats(reads=0, batches=0, fallback_reads=0, rows=0, extra=1)  # type: ignore[call-arg]
