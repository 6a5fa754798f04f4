"""What the journal costs and buys (docs/journal.md), against baselines measured in the same run.

    .venv/bin/python bench/journal_bench.py [--rollouts 20000] [--threads 64]
        [--flush-ms 0.5,1,2,5] [--records 1000000] [--json]

1. **Seal throughput, journal on vs off**: ``--threads`` sealers, each dispatching and sealing
   its share of ``--rollouts`` rollouts (a 512-token row) through one controller in this
   process; off (the baseline) and on at each ``--flush-ms``, alternated. Target: on/off at
   least 0.95.
2. **Journal bytes per rollout** (its hand-out share, dispatch and seal records, the row
   included) at the default flush interval.
3. **The loss window**: how long a seal waits for its batch to be durable (what a whole-run
   crash can lose of a seal not yet acknowledged), p50 / p99 / max, per flush interval.
4. **Replay at ``--records`` records**: restore of a snapshot taken before them plus the
   journal after it, vs restore of a snapshot taken after them (the same state) alone.
   Target: within 2x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from rollsafe.checkpoint.controller import Controller
from rollsafe.core.config import JOURNAL_FLUSH_MS, RunConfig
from rollsafe.core.run_state import RunState
from rollsafe.dataplane import make_dataplane
from rollsafe.journal.run import JOURNAL_DIR, RunJournal
from rollsafe.snapshot import SnapshotStore, state_files

GROUP = 8
ROW = {
    "tokens": np.arange(512, dtype=np.int32),
    "logprobs": np.zeros(512, dtype=np.float32),
    "reward": np.array(1.0, np.float32),
}
SMALL_ROW = {"tokens": np.arange(16, dtype=np.int32)}


def sealing(root: Path, rollouts: int, threads: int, flush_ms: float | None) -> dict[str, Any]:
    """Seal ``rollouts`` with ``threads`` sealers; None: the journal off."""
    run_id = f"seal-{flush_ms}".replace(".", "_")
    store = SnapshotStore(root, run_id)
    config = RunConfig(run_id=run_id, group_size=GROUP, groups_per_step=4)
    journal = None if flush_ms is None else RunJournal.for_store(store, flush_ms=flush_ms)
    ctl = Controller.from_parts(RunState(config, make_dataplane("memory")), store, journal=journal)
    ctl.handout(list(range(rollouts // GROUP)))
    waits: list[float] = []

    def sealer(first: int) -> None:
        mine: list[float] = []
        for n in range(first, rollouts, threads):
            episode = ctl.dispatch(n // GROUP, n % GROUP)
            assert episode is not None
            began = time.perf_counter()
            ctl.seal(n // GROUP, n % GROUP, episode.attempt, ROW)
            mine.append(time.perf_counter() - began)
        waits.extend(mine)

    workers = [threading.Thread(target=sealer, args=(k,)) for k in range(threads)]
    start, cpu = time.perf_counter(), time.process_time()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {
        "rollouts_per_s": rollouts / seconds,
        # CPU of this process per rollout (every thread, the flusher's included).
        "cpu_us_per_rollout": 1e6 * (time.process_time() - cpu) / rollouts,
    }
    if journal is not None:
        journal.close()
        size = sum(p.stat().st_size for p in (store.run_dir / JOURNAL_DIR).iterdir())
        waits.sort()
        result |= {
            "bytes_per_rollout": size / rollouts,
            "seal_wait_ms": {
                "p50": 1000 * statistics.median(waits),
                "p99": 1000 * waits[int(0.99 * (len(waits) - 1))],
                "max": 1000 * waits[-1],
            },
        }
    return result


def replaying(root: Path, records: int) -> dict[str, Any]:
    """Snapshot A (nothing), ``records`` journal records, snapshot B: restore A + journal vs
    B alone (the same state)."""
    run_id = "replay"
    store = SnapshotStore(root, run_id)
    config = RunConfig(run_id=run_id, group_size=GROUP, groups_per_step=4)
    journal = RunJournal.for_store(store, flush_ms=JOURNAL_FLUSH_MS)
    state = RunState(config, make_dataplane("memory"))
    journal.start(state)
    state_files.checkpoint(state, store, "a")
    rollouts = records // 2  # a dispatch and a seal each (hand-outs: one per 1,024 groups)
    for base in range(0, rollouts // GROUP, 1024):
        state.handout(list(range(base, min(base + 1024, rollouts // GROUP))))
    for n in range(rollouts // GROUP * GROUP):
        state.dispatch(n // GROUP, n % GROUP)
        state.seal(n // GROUP, n % GROUP, 0, SMALL_ROW)
    journal.wait_durable(journal.last_id)
    written = journal.last_id
    state_files.checkpoint(state, store, "b")
    journal.close()

    def restore(seq: int, replay: bool) -> float:
        again = RunJournal.for_store(store, flush_ms=JOURNAL_FLUSH_MS)
        started = time.perf_counter()
        state_files.restore(
            config,
            store,
            make_dataplane("memory"),
            accept=lambda m: None if m.seq == seq else "not this one",
            journal=again.replayer() if replay else None,
        )
        seconds = time.perf_counter() - started
        if replay:
            again.resume()
        again.close()
        return seconds

    alone = restore(2, replay=False)
    with_journal = restore(1, replay=True)
    return {
        "records": written,
        "snapshot_alone_s": alone,
        "snapshot_plus_journal_s": with_journal,
        "ratio": with_journal / alone,
        "records_per_s": written / with_journal,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=20_000)
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--flush-ms", default=f"0.5,1,2,{JOURNAL_FLUSH_MS:g}")
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    intervals = [float(x) for x in args.flush_ms.split(",")]
    report: dict[str, Any] = {"seal": {}, "replay": None}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for flush_ms in intervals:
            off = sealing(root / f"off-{flush_ms}", args.rollouts, args.threads, None)
            on = sealing(root / f"on-{flush_ms}", args.rollouts, args.threads, flush_ms)
            on["ratio"] = on["rollouts_per_s"] / off["rollouts_per_s"]
            report["seal"][f"{flush_ms:g}"] = {"off": off, "on": on}
            if not args.json:
                wait = on["seal_wait_ms"]
                print(
                    f"flush {flush_ms:g} ms: off {off['rollouts_per_s']:,.0f}/s, on "
                    f"{on['rollouts_per_s']:,.0f}/s, ratio {on['ratio']:.2f} (target >= 0.95); "
                    f"CPU {off['cpu_us_per_rollout']:.0f} -> {on['cpu_us_per_rollout']:.0f} "
                    f"us/rollout; {on['bytes_per_rollout']:,.0f} bytes/rollout; seal waits p50 "
                    f"{wait['p50']:.2f} ms, p99 {wait['p99']:.2f} ms, max {wait['max']:.2f} ms",
                    flush=True,
                )
        if args.records:
            replay = replaying(root / "replay", args.records)
            report["replay"] = replay
            if not args.json:
                print(
                    f"replay: {replay['records']:,} records; snapshot alone "
                    f"{replay['snapshot_alone_s']:.2f} s, snapshot + journal "
                    f"{replay['snapshot_plus_journal_s']:.2f} s, ratio {replay['ratio']:.2f} "
                    f"(target <= 2), {replay['records_per_s']:,.0f} records/s"
                )
    if args.json:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
