"""TransferQueue data plane: capture/restore against the disk and TransferQueue itself, and
coalesced vs one-read-per-caller prefix reads.

    .venv/bin/python bench/dataplane_bench.py [--quick] [--repeats 3] [--json PATH] [--dir DIR]

One Ray + TransferQueue, started and stopped by this process (``transferqueue_running``).

1. Capture/restore, per shape (rows x tokens; a row = int32 tokens + float32 logprobs, seeded;
   MB = the rows' array bytes). Rows are put before the clock starts. Timed: *capture* =
   ``plane.export`` into a fresh directory; *restore* = ``import_`` into a new empty plane (then,
   untimed, every row is read back and its digest compared with what was put). Baselines, same
   run, same directory: *plain* = ``baseline_write`` of the same byte count (write + fsync, the
   physical limit; target capture/plain >= 0.5); *tq get* = every row read with
   TransferQueue's own ``kv_batch_get`` in batches of BATCH_ROWS, nothing decoded, checked or
   written (its transfer alone: the ceiling of any capture through its client); *native* =
   ``save_checkpoint`` (pickles, no fsync: timed alone and with an ``os.sync()`` after; never
   loaded). The restore reads files that are still in the page cache.
2. Prefix reads: K staged prefix records (~200 tokens, MoE routes). Timed: K tasks each calling
   ``PrefixReader.read`` (coalesced) vs K tasks each reading its own key through
   ``asyncio.to_thread(plane.get, ...)``, at most 8 at once. Both decode and verify the record.
   Counted: data-plane get calls. Every record read must equal the staged one.

``--quick``: 1,000 x 1,000 and 100 x 8,000 rows, K = 200, one repeat. ``--repeats N``: medians
(default 3). An untimed tiny capture/checkpoint/restore runs first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from rollsafe.dataplane import DataPlane
from rollsafe.dataplane.protocol import row_digest
from rollsafe.dataplane.tq_runtime import import_tq, transferqueue_running
from rollsafe.dataplane.transferqueue import BATCH_ROWS, TransferQueueDataPlane
from rollsafe.engine.protocol import PrefixRecord, SamplingParams, prompt_digest, seal_prefix
from rollsafe.engine.staging import (
    PREFIX_PARTITION,
    PrefixReader,
    prefix_key,
    row_to_record,
    stage_prefixes,
)

if TYPE_CHECKING:  # mypy reads bench/ as a package; run, bench/ is on sys.path
    from bench.env_bench import table
    from bench.snapshot_bench import baseline_write
else:
    from env_bench import table  # the same aligned-table printer
    from snapshot_bench import baseline_write  # the same plain write + fsync baseline

PARTITION = "rollouts"
PUT_ROWS = 1_000  # rows generated and put at a time (the plane batches them by BATCH_ROWS)
TARGET = 0.5  # capture / plain write
SINGLE_CONCURRENCY = 8
MB = 1e6


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def fill(plane: TransferQueueDataPlane, rows: int, tokens: int, seed: int) -> dict[str, bytes]:
    """Put ``rows`` random rows; key -> digest of what was put."""
    rng = np.random.default_rng(seed)
    digests: dict[str, bytes] = {}
    for start in range(0, rows, PUT_ROWS):
        n = min(PUT_ROWS, rows - start)
        toks = rng.integers(0, 50_000, (n, tokens), dtype=np.int32)
        lps = rng.standard_normal((n, tokens), dtype=np.float32)
        batch = {f"r{start + i:07d}": {"tokens": toks[i], "logprobs": lps[i]} for i in range(n)}
        plane.put(PARTITION, batch)
        digests.update((key, row_digest(row)) for key, row in batch.items())
    return digests


def get_all(plane: TransferQueueDataPlane, keys: Sequence[str]) -> None:
    """TransferQueue's own multi-key read, nothing decoded or checked: its transfer alone."""
    tq, partition = import_tq(), f"{plane.namespace}/{PARTITION}"
    for start in range(0, len(keys), BATCH_ROWS):
        tq.kv_batch_get(keys=list(keys[start : start + BATCH_ROWS]), partition_id=partition)


def verify(plane: TransferQueueDataPlane, digests: dict[str, bytes]) -> None:
    keys = sorted(digests)
    if plane.count(PARTITION) != len(keys):
        raise RuntimeError(f"restored {plane.count(PARTITION)} rows of {len(keys)}")
    for start in range(0, len(keys), BATCH_ROWS):
        for key, row in plane.get(PARTITION, keys[start : start + BATCH_ROWS]).items():
            if row_digest(row) != digests[key]:
                raise RuntimeError(f"restored row {key} differs from the row put")


def warm_up(root: Path) -> None:
    """A tiny capture, checkpoint and restore, untimed: first-call costs stay out of case 1."""
    plane, fresh = TransferQueueDataPlane(), TransferQueueDataPlane()
    try:
        fill(plane, 8, 16, 0)
        manifest = plane.export(root / "warm" / "export")
        import_tq().save_checkpoint(root / "warm" / "native" / "tq")
        fresh.import_(root / "warm" / "export", manifest)
    finally:
        plane.clear()
        fresh.clear()
        shutil.rmtree(root / "warm", ignore_errors=True)


def capture_case(rows: int, tokens: int, repeats: int, root: Path) -> dict[str, Any]:
    plane = TransferQueueDataPlane()
    nbytes = rows * tokens * 8
    times: dict[str, list[float]] = {
        k: [] for k in ("get", "capture", "restore", "plain", "native", "native_sync")
    }
    try:
        put_s, digests = timed(fill, plane, rows, tokens, rows + tokens)
        keys = sorted(digests)
        data = memoryview(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).data)
        for r in range(repeats):
            case = root / f"{rows}x{tokens}-{r}"
            case.mkdir()
            os.sync()  # untimed, before each measurement: no dirty pages queued
            times["get"].append(timed(get_all, plane, keys)[0])
            os.sync()
            capture_s, manifest = timed(plane.export, case / "export")
            times["capture"].append(capture_s)
            os.sync()
            times["plain"].append(baseline_write(case / "plain", data))
            os.sync()
            times["native"].append(timed(import_tq().save_checkpoint, case / "native" / "tq")[0])
            times["native_sync"].append(times["native"][-1] + timed(os.sync)[0])
            native = [f for f in (case / "native").rglob("*") if f.is_file()]
            native_bytes = sum(f.stat().st_size for f in native)
            export_bytes = sum(f.bytes for f in manifest.files)
            fresh = TransferQueueDataPlane()
            try:
                times["restore"].append(timed(fresh.import_, case / "export", manifest)[0])
                verify(fresh, digests)  # untimed: the round trip must be exact
            finally:
                fresh.clear()
            shutil.rmtree(case)
    finally:
        plane.clear()
    med = {k: statistics.median(v) for k, v in times.items()}
    speed = {f"{k}_mbps": nbytes / MB / v for k, v in med.items()}
    row: dict[str, Any] = {"rows": rows, "tokens": tokens, "mb": nbytes / MB, "put_s": put_s}
    row |= {f"{k}_s": v for k, v in med.items()} | speed
    row |= {"export_mb": export_bytes / MB, "native_mb": native_bytes / MB}
    row |= {
        "plain_ratio": med["plain"] / med["capture"],
        "get_share": med["get"] / med["capture"],
        "native_ratio": med["native"] / med["capture"],
        "native_sync_ratio": med["native_sync"] / med["capture"],
        "native_size": native_bytes / nbytes,
        "restore_vs_get": med["get"] / med["restore"],
    }
    return row | {"all_s": times}


def prefix(i: int) -> PrefixRecord:
    n = 190 + i % 21  # ~200 tokens
    return seal_prefix(
        call_id=f"call-{i:05d}",
        model="ab" * 32,
        prompt_digest=prompt_digest((1, 2, 3, i)),
        sampling=SamplingParams(seed=i, max_tokens=256),
        tokens=tuple((i * 7 + j) % 50_000 for j in range(n)),
        logprobs=tuple(-((i + j) % 64) / 64 for j in range(n)),  # exact in float32
        weight_versions=(i % 3,) * n,
        routes=tuple(((j % 8, (j + i) % 8),) for j in range(n)),
    )


class CountingPlane:
    """Delegates ``get`` to the plane and counts the calls."""

    def __init__(self, plane: TransferQueueDataPlane) -> None:
        self.plane, self.gets, self._lock = plane, 0, threading.Lock()

    def get(self, partition: str, keys: Any) -> dict[str, dict[str, np.ndarray]]:
        with self._lock:
            self.gets += 1
        return self.plane.get(partition, keys)


async def read_each(
    plane: TransferQueueDataPlane, ids: list[str], coalesce: bool
) -> tuple[float, int, list[PrefixRecord]]:
    """One task per call id: through one PrefixReader, or one get per caller (<= 8 at once)."""
    counting = CountingPlane(plane)
    reader = PrefixReader(cast(DataPlane, counting))
    gate = asyncio.Semaphore(SINGLE_CONCURRENCY)

    async def alone(call_id: str) -> PrefixRecord:
        key = prefix_key(call_id)
        async with gate:
            rows = await asyncio.to_thread(counting.get, PREFIX_PARTITION, [key])
        return row_to_record(key, rows[key])

    start = time.perf_counter()
    got = await asyncio.gather(*((reader.read if coalesce else alone)(i) for i in ids))
    return time.perf_counter() - start, counting.gets, got


async def prefix_reads(k: int, repeats: int) -> dict[str, Any]:
    # More threads than the default min(32, cpus + 4), so the semaphore's 8 is the real limit.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(SINGLE_CONCURRENCY))
    records = [prefix(i) for i in range(k)]
    ids = [r.call_id for r in records]
    plane = TransferQueueDataPlane()
    runs: dict[str, list[tuple[float, int]]] = {"coalesced": [], "single": []}
    try:
        stage_prefixes(plane, records)
        plane.get(PREFIX_PARTITION, [prefix_key(ids[0])])  # warm-up, untimed
        for r in range(repeats):
            for name in ("coalesced", "single")[:: 1 if r % 2 == 0 else -1]:
                wall, gets, got = await read_each(plane, ids, name == "coalesced")
                if got != records:
                    raise RuntimeError(f"{name}: a record read differs from the one staged")
                runs[name].append((wall, gets))
    finally:
        plane.clear()
    row: dict[str, Any] = {"k": k}
    for name, values in runs.items():
        row[f"{name}_s"] = statistics.median(w for w, _ in values)
        row[f"{name}_gets"] = statistics.median(g for _, g in values)
    row["gets_ratio"] = row["single_gets"] / row["coalesced_gets"]
    row["wall_ratio"] = row["single_s"] / row["coalesced_s"]
    return row | {"all": runs}


SPEED = (
    "rows rows ,d; tokens tokens ,d; MB mb .1f; put_s put_s .2f; capture capture_mbps .0f;"
    "restore restore_mbps .0f; plain plain_mbps .0f; tq_get get_mbps .0f;"
    "native native_mbps .0f; nat+sync native_sync_mbps .0f"
)
RATIOS = (
    "rows rows ,d; tokens tokens ,d; cap/plain plain_ratio .2f; get/cap get_share .2f;"
    "cap/native native_ratio .2f; c/nat+sync native_sync_ratio .2f; export_MB export_mb .1f;"
    "native_MB native_mb .1f; native/data native_size .2f"
)
PREFIX = (
    "K k ,d; coal_gets coalesced_gets .0f; single_gets single_gets .0f; gets_ratio gets_ratio .1f;"
    "coal_ms coalesced_s .1f; single_ms single_s .1f; wall_ratio wall_ratio .2f"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="10000x1000,1000x8000", help="rows x tokens, ...")
    parser.add_argument("--prefixes", type=int, default=1_000, help="K staged prefix records")
    parser.add_argument("--repeats", type=int, help="medians; default 3 (--quick: 1)")
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="parent of the temp dir")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--quick", action="store_true", help="1,000x1,000, 100x8,000, K=200")
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.prefixes = "1000x1000,100x8000", 200
    args.repeats = args.repeats or (1 if args.quick else 3)
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    start = time.perf_counter()
    print(f"python {platform.python_version()}; cpus={os.cpu_count()}; {platform.platform()}")
    print(f"dir={args.dir}; repeats={args.repeats} (medians); BATCH_ROWS={BATCH_ROWS}")
    root = Path(tempfile.mkdtemp(prefix=".dataplane-bench-", dir=args.dir))
    try:
        tq_start = time.perf_counter()
        with transferqueue_running():
            print(f"Ray + TransferQueue up in {time.perf_counter() - tq_start:.1f} s")
            warm_up(root)
            cases = [capture_case(rows, tokens, args.repeats, root) for rows, tokens in shapes]
            prefix_row = asyncio.run(prefix_reads(args.prefixes, args.repeats))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n1a. capture / restore throughput, MB/s of row bytes (plain = write + fsync)")
    table(cases, SPEED)
    print("\n1b. ratios. cap/plain: fraction of the physical limit; get/cap: share of the")
    print("    capture time TransferQueue's own get takes; cap/native: speed vs its checkpoint")
    table(cases, RATIOS)
    print(f"\n2. {args.prefixes:,} prefix reads: PrefixReader vs one get per caller (<= 8 at once)")
    table([{**prefix_row, **{k: prefix_row[k] * 1e3 for k in ("coalesced_s", "single_s")}}], PREFIX)
    print()
    for c in cases:
        verdict = "MET" if c["plain_ratio"] >= TARGET else "MISSED"
        print(
            f"target capture/plain-write >= {TARGET} at {c['rows']:,} x {c['tokens']:,}: "
            f"{c['plain_ratio']:.2f} {verdict} (capture {c['capture_mbps']:.0f} MB/s, plain "
            f"{c['plain_mbps']:.0f} MB/s, TQ get alone {c['get_mbps']:.0f} MB/s)"
        )
    p = prefix_row
    print(
        f"coalesced prefix reads: {p['coalesced_gets']:.0f} get calls for {p['k']:,} callers "
        f"(one per caller: {p['single_gets']:.0f}; x{p['gets_ratio']:.0f} fewer), wall "
        f"{p['coalesced_s'] * 1e3:.0f} ms vs {p['single_s'] * 1e3:.0f} ms "
        f"(x{p['wall_ratio']:.2f}); wall {time.perf_counter() - start:.1f} s"
    )
    if args.json:
        machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "dir": str(args.dir)}
        out = {"machine": machine, "repeats": args.repeats, "capture": cases, "prefix": prefix_row}
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
