"""Checkpoint and restore of a ledger + replay index against the disk's own speed.

    .venv/bin/python bench/snapshot_bench.py --sizes 10000,100000,1000000 --repeats 7

Checkpoint (timed): ``RunState.capture`` + the ledger/index agreement check + a published
snapshot with ``ledger.safetensors``, ``replay_index.safetensors``, ``loader.json``,
``sampler.json`` and ``run.json`` written by ``state_files.write_state`` (hash while writing, fsync
per file, directory fsyncs, manifest last, atomic rename, LATEST, retention) — the controller's
own path without the data plane. Restore (timed): ``store.select(contents=False)`` (manifest,
file list, sizes) + ``state_files.read_state`` (each file hashed as it is read) +
``verify_unread`` + ``Ledger.restore`` + ``ReplayIndex.restore``; and, timed apart in the same
round, the path before (*verify-first*: ``select()`` hashes every file, the reads again).

Baselines, same directory, same run, alternating with the real path: *write* = open a new
file, write the snapshot's byte count from a pre-built buffer in 8 MiB chunks, fsync it,
close, fsync its directory; *read* = read that file back (from the page cache: it was just
written) in 8 MiB chunks into a pre-allocated buffer. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from rollsafe.core.buffer.index import ReplayIndex
from rollsafe.core.buffer.samplers import InOrderSampler
from rollsafe.core.capture import check_agreement
from rollsafe.core.columns import in_key_order
from rollsafe.core.config import RunConfig
from rollsafe.core.ledger import Ledger
from rollsafe.core.run_state import RunState
from rollsafe.core.states import RestoreLevel
from rollsafe.dataplane.memory import MemoryDataPlane
from rollsafe.snapshot import PublishedSnapshot, SnapshotKind, SnapshotStore, state_files
from rollsafe.snapshot._fs import fsync_dir

GROUP_SIZE = 8
RUN_ID = "bench"
CHUNK = 8 << 20
KEEP = 2  # the store's default retention: in steady state every publish retires one snapshot
LEVELS = list(RestoreLevel)


def build(rollouts: int) -> tuple[Ledger, ReplayIndex]:
    """Half the rollouts sealed, a quarter dispatched (half of those with an owner), a quarter
    reserved. Groups cycle through 4 shapes: 8 sealed (READY; 1 in 25 of these CLAIMED);
    4 sealed + 2 dispatched + 2 reserved (twice); 4 dispatched + 4 reserved."""
    ledger, index = Ledger(RUN_ID, GROUP_SIZE), ReplayIndex(GROUP_SIZE)
    for idx in range(rollouts // GROUP_SIZE):
        sealed, dispatched = ((8, 0), (4, 2), (4, 2), (0, 4))[idx % 4]
        version = idx // 1000
        ledger.reserve_group(idx, LEVELS[idx % len(LEVELS)])
        index.reserve(idx, version)
        for i in range(sealed + dispatched):
            ledger.dispatch(idx, i, f"env-{(idx + i) % 16}" if (idx + i) % 2 else None)
        if sealed + dispatched:
            index.start(idx, version)
        for i in range(sealed):
            digest = hashlib.sha256(f"{RUN_ID}/{idx}/{i}".encode()).digest()
            ledger.seal(idx, i, ledger.attempt(idx, i), digest)
        index.set_sealed(idx, sealed)
    index.claim(range(0, rollouts // GROUP_SIZE, 100), step=7)  # idx % 100 == 0 is READY
    return ledger, index


def checkpoint(store: SnapshotStore, run: RunState, sealed: int, seq: int) -> PublishedSnapshot:
    """state_files.checkpoint minus the data plane (whose rows this benchmark does not hold):
    capture, the agreement check, the state files, publish."""
    state = run.capture().in_key_order()
    check_agreement(state, rows=sealed)
    with store.begin(SnapshotKind.ROLLOUT, f"bench-{seq}", seq) as draft:
        state_files.write_state(draft, state)
        return draft.publish(
            weight_version=run.weight_version,
            loader_position=run.loader_position,
            counts={**state.counts(), "sealed_rollouts": sealed},
        )


def restore(store: SnapshotStore, *, verify_first: bool = False) -> tuple[Ledger, ReplayIndex]:
    """What state_files.load_newest does for the same files: each file hashed as it is loaded, the
    rest after (``verify_first``: select hashes every file first and the loads hash them
    again, the path before restores hashed once)."""
    reader = store.select(contents=verify_first)
    state = state_files.read_state(reader)
    reader.verify_unread()
    ledger = Ledger.restore(*state.ledger, "ledger")
    index = ReplayIndex.restore(*state.index, "index")
    InOrderSampler().load_state(state.sampler, index)
    return ledger, index


def snapshot_bytes(published: PublishedSnapshot) -> int:
    """Every file of the snapshot directory, manifest included (LATEST is not counted)."""
    return sum(f.stat().st_size for f in published.path.iterdir())


def baseline_write(path: Path, data: memoryview) -> float:
    start = time.perf_counter()
    with open(path, "xb", buffering=0) as handle:
        for offset in range(0, len(data), CHUNK):
            handle.write(data[offset : offset + CHUNK])
        os.fsync(handle.fileno())
    fsync_dir(path.parent)
    return time.perf_counter() - start


def baseline_read(path: Path, into: memoryview) -> float:
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        offset = 0
        while n := handle.readinto(into[offset : offset + CHUNK]):
            offset += n
    return time.perf_counter() - start


def same(a: tuple[dict[str, np.ndarray], dict[str, str]], b: Ledger | ReplayIndex) -> bool:
    arrays, meta = b.capture()
    mine, theirs = in_key_order(a[0]), in_key_order(arrays)
    return meta == a[1] and all(np.array_equal(theirs[k], v) for k, v in mine.items())


def profile_checkpoint(
    store: SnapshotStore, run: RunState, sealed: int, seq: int, profile: Path
) -> None:
    """One more checkpoint under cProfile: stats to ``profile``, the top 15 to stderr."""
    os.sync()
    store.sweep()
    profiler = cProfile.Profile()
    profiler.runcall(checkpoint, store, run, sealed, seq)
    profiler.dump_stats(profile)
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(15)


def real_round(
    store: SnapshotStore, run: RunState, sealed: int, seq: int
) -> tuple[tuple[float, ...], tuple[Ledger, ReplayIndex]]:
    """Seconds of the sweep, the checkpoint, the restore and the verify-first restore, and
    what the restore gave back. Retention only renames old snapshots to trash; their bytes
    are deleted by the sweep at the next begin. Timed apart: it is housekeeping, not capture
    or publish (see docs/benchmarks.md)."""
    t0 = time.perf_counter()
    store.sweep()
    t1 = time.perf_counter()
    checkpoint(store, run, sealed, seq)
    t2 = time.perf_counter()
    restored = restore(store)
    t3 = time.perf_counter()
    restore(store, verify_first=True)
    t4 = time.perf_counter()
    return (t1 - t0, t2 - t1, t3 - t2, t4 - t3), restored


def measure(rollouts: int, repeats: int, root: Path, profile: Path | None) -> dict[str, Any]:
    start = time.perf_counter()
    ledger, index = build(rollouts)
    build_s = time.perf_counter() - start
    config = RunConfig(run_id=RUN_ID, group_size=GROUP_SIZE, groups_per_step=4, sampler="in_order")
    run = RunState(config, MemoryDataPlane())
    run.ledger, run.index, run.loader_position = ledger, index, len(index)
    sealed = sum(ledger.sealed_counts().values())  # about half, by construction
    store = SnapshotStore(root / f"store-{rollouts}", RUN_ID, keep_latest_k=KEEP)
    seq = 0
    for seq in range(1, KEEP + 1):  # warm-up, untimed: reach retention's steady state
        published = checkpoint(store, run, sealed, seq)
    size = snapshot_bytes(published)
    data = memoryview(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).data)
    into = memoryview(bytearray(size))
    base_dir = root / f"baseline-{rollouts}"
    base_dir.mkdir()
    fsync_dir(root)
    baseline_write(base_dir / "warm-up", data)  # untimed, like the real path's warm-up
    (base_dir / "warm-up").unlink()
    ckpt: list[float]
    rest: list[float]
    twice: list[float]
    sweep: list[float]
    ckpt, rest, twice, bw, br, sweep = [], [], [], [], [], []
    for r in range(repeats):
        for real in (r % 2 == 1, r % 2 == 0):  # alternate which one goes first
            os.sync()  # untimed: start each measurement with no dirty pages queued
            if real:
                seq += 1
                times, restored = real_round(store, run, sealed, seq)
                for into_list, took in zip((sweep, ckpt, rest, twice), times, strict=True):
                    into_list.append(took)
                if r == 0 and not (
                    same(ledger.capture(), restored[0]) and same(index.capture(), restored[1])
                ):
                    raise RuntimeError(f"{rollouts}: restored state differs from the captured")
            else:
                path = base_dir / f"plain-{r}"
                bw.append(baseline_write(path, data))
                br.append(baseline_read(path, into))
                path.unlink()
    if profile is not None:
        profile_checkpoint(store, run, sealed, seq + 1, profile)
    shutil.rmtree(store.root)
    shutil.rmtree(base_dir)
    c, w, rs, rd = (statistics.median(x) for x in (ckpt, bw, rest, br))
    row = {"rollouts": rollouts, "groups": len(index), "bytes": size, "build_s": build_s}
    row |= {"checkpoint_s": c, "rollouts_per_s": rollouts / c, "us_per_rollout": c / rollouts * 1e6}
    row |= {"baseline_write_s": w, "write_ratio": w / c, "write_ratio_min": min(bw) / min(ckpt)}
    row |= {"sweep_s": statistics.median(sweep), "restore_s": rs}
    row |= {"restore_twice_s": statistics.median(twice)}
    row |= {"restore_rollouts_per_s": rollouts / rs, "baseline_read_s": rd, "read_ratio": rd / rs}
    all_runs = {
        "checkpoint": ckpt,
        "baseline_write": bw,
        "restore": rest,
        "restore_verify_first": twice,
        "baseline_read": br,
        "sweep": sweep,
    }
    return row | {"all_s": all_runs}


# (header, key, format) of the printed table
TABLE = [
    ("rollouts", "rollouts", ",d"),
    ("bytes", "bytes", ",d"),
    ("build s", "build_s", ".1f"),
    ("ckpt s", "checkpoint_s", ".4f"),
    ("rollouts/s", "rollouts_per_s", ",.0f"),
    ("us/rollout", "us_per_rollout", ".3f"),
    ("write s", "baseline_write_s", ".4f"),
    ("w ratio", "write_ratio", ".2f"),
    ("w ratio min", "write_ratio_min", ".2f"),
    ("sweep s", "sweep_s", ".4f"),
    ("restore s", "restore_s", ".4f"),
    ("hash 2x s", "restore_twice_s", ".4f"),
    ("read s", "baseline_read_s", ".4f"),
    ("r ratio", "read_ratio", ".3f"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000", help="rollout counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="parent of the temp dir")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--profile", type=Path, help="cProfile one extra largest checkpoint")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix=".snapshot-bench-", dir=args.dir))
    try:
        profile = {max(sizes): args.profile}
        rows = [measure(n, args.repeats, root, profile.get(n)) for n in sizes]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fit = {}
    if len(rows) > 1:  # checkpoint_s ~ fixed + per_rollout * rollouts (least squares, medians)
        slope, fixed = np.polyfit(
            [r["rollouts"] for r in rows], [r["checkpoint_s"] for r in rows], 1
        )
        fit = {"fixed_s": float(fixed), "per_rollout_us": float(slope) * 1e6}
    if args.json:
        machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "dir": str(args.dir)}
        out = {"machine": machine, "repeats": args.repeats, "rows": rows, "checkpoint_fit": fit}
        print(json.dumps(out, indent=2))
        return
    print(f"repeats={args.repeats} (medians); dir={args.dir}; group_size={GROUP_SIZE}")
    print("".join(f"{head:>13}" for head, _key, _fmt in TABLE))
    for row in rows:
        print("".join(f"{row[key]:>13{fmt}}" for _head, key, fmt in TABLE))
    if fit:
        fixed_ms, per_us = fit["fixed_s"] * 1e3, fit["per_rollout_us"]
        print(f"checkpoint fit (medians): {fixed_ms:.1f} ms + {per_us:.3f} us/rollout")


if __name__ == "__main__":
    main()
