"""Coalesce concurrent single-row reads into one multi-key data-plane read.

A restore resumes many calls at once, and each needs its staged generation prefix: N tasks each
asking for one row would cost N round trips. Reads that arrive within a short window (or until
the window holds ``max_rows`` keys) go out as one ``get``. When that read fails, each key is read
alone once, so every caller gets its own row or its own error, and an outage costs N+1 reads.
"""

from __future__ import annotations

import asyncio
import math
from typing import Final

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from rollsafe.dataplane.protocol import DataPlane
from rollsafe.dataplane.rows import check_key, check_partition
from rollsafe.errors import DataPlaneKeyMissing, InvalidInput

DEFAULT_WINDOW_S: Final = 0.002
DEFAULT_MAX_ROWS: Final = 256

_Result = dict[str, np.ndarray]
_Waiters = dict[str, list[asyncio.Future[_Result]]]  # key -> futures of its callers


class BatcherStats(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    reads: int = Field(ge=0, description="data-plane get calls issued")
    batches: int = Field(ge=0, description="multi-key reads among them")
    fallback_reads: int = Field(ge=0, description="single-key reads after a failed batch")
    rows: int = Field(ge=0, description="rows handed to callers")


class ReadBatcher:
    """Batches ``read(key)`` calls made on one event loop into ``dataplane.get`` calls."""

    def __init__(
        self,
        dataplane: DataPlane,
        partition: str,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        max_rows: int = DEFAULT_MAX_ROWS,
    ) -> None:
        check_partition(partition)
        if isinstance(window_s, bool) or not isinstance(window_s, int | float):
            raise InvalidInput(f"window_s must be a number of seconds, got {window_s!r}")
        if not (math.isfinite(window_s) and window_s >= 0):
            raise InvalidInput(f"window_s must be finite and >= 0, got {window_s!r}")
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise InvalidInput(f"max_rows must be an integer >= 1, got {max_rows!r}")
        self._dataplane = dataplane
        self._partition = partition
        self._window_s = float(window_s)
        self._max_rows = max_rows
        self._open: _Waiters | None = None
        self._timer: asyncio.TimerHandle | None = None
        # The loop keeps only weak references to tasks; a dropped batch would strand its callers.
        self._tasks: set[asyncio.Task[None]] = set()
        self._reads = self._batches = self._fallback_reads = self._rows = 0

    @property
    def stats(self) -> BatcherStats:
        return BatcherStats(
            reads=self._reads,
            batches=self._batches,
            fallback_reads=self._fallback_reads,
            rows=self._rows,
        )

    async def read(self, key: str) -> dict[str, np.ndarray]:
        """The row stored under ``key``; raises what reading that key alone would raise."""
        # Checked here, so a malformed key fails its own caller and never joins a batch.
        check_key(key)
        loop = asyncio.get_running_loop()
        if self._open is None:
            self._open = {}
            self._timer = loop.call_later(self._window_s, self._dispatch)
        future: asyncio.Future[_Result] = loop.create_future()
        self._open.setdefault(key, []).append(future)
        if len(self._open) >= self._max_rows:
            self._dispatch()
        return await future

    def _dispatch(self) -> None:
        waiters, self._open = self._open, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if waiters:
            task = asyncio.get_running_loop().create_task(self._run(waiters))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, waiters: _Waiters) -> None:
        keys = list(waiters)
        try:
            try:
                rows = await self._get(keys)
            except Exception as exc:
                if len(keys) == 1:  # reading it alone again would be the same read
                    self._fail(waiters[keys[0]], exc)
                    return
                # One read per key, no bisection: the cost of an outage stays N+1.
                await asyncio.gather(*(self._read_alone(key, waiters[key]) for key in keys))
                return
            for key in keys:
                if key in rows:
                    self._deliver(waiters[key], rows[key])
                else:  # a backend that broke the exact-read contract still names the key
                    self._fail(waiters[key], DataPlaneKeyMissing(self._partition, [key]))
        finally:
            # If this task itself is cancelled, its callers must not wait forever.
            for futures in waiters.values():
                for future in futures:
                    future.cancel()  # a no-op on futures already done

    async def _read_alone(self, key: str, futures: list[asyncio.Future[_Result]]) -> None:
        self._fallback_reads += 1
        try:
            rows = await self._get([key])
        except Exception as exc:
            self._fail(futures, exc)
        else:
            if key in rows:
                self._deliver(futures, rows[key])
            else:
                self._fail(futures, DataPlaneKeyMissing(self._partition, [key]))

    async def _get(self, keys: list[str]) -> dict[str, _Result]:
        self._reads += 1
        if len(keys) > 1:
            self._batches += 1
        # Blocking I/O off the loop: reads made meanwhile keep filling the next window.
        return await asyncio.to_thread(self._dataplane.get, self._partition, keys)

    def _deliver(self, futures: list[asyncio.Future[_Result]], row: _Result) -> None:
        for future in futures:
            if not future.done():  # a cancelled caller is skipped, not an error for the rest
                # Each caller gets its own dict, so one caller's edits never reach another.
                future.set_result(dict(row))
                self._rows += 1

    @staticmethod
    def _fail(futures: list[asyncio.Future[_Result]], error: Exception) -> None:
        for future in futures:
            if not future.done():
                future.set_exception(error)
