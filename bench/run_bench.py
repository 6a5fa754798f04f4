"""The reference run under snapshots: rollout throughput with and without a snapshot every
``--interval`` seconds, the park window and the snapshot's time, at growing ledger sizes.

    .venv/bin/python bench/run_bench.py [--sizes 1000,10000,200000] [--seconds 20]
                                        [--interval 10] [--rounds 5] [--json] [--quick]

Real servers (``RunServers``: engine + workplace environments) and a ``ReferenceController`` in this
process; ``--groups`` real groups kept generating (sealed groups committed as trained, no
optimizer) beside ``size`` simulated in-flight rollouts in the ledger (dispatched, no episode).
Per size, ``--rounds`` pairs of windows without / with snapshots, order alternating (AB BA ...).
What is measured and why: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast

from rollsafe.core.phases import PHASES, Phase, PhaseRequest, SnapshotSpec
from rollsafe.core.states import GroupState
from rollsafe.errors import TransientError
from rollsafe.http.served import ServedProcess
from rollsafe.reference.rl.controller import ReferenceController
from rollsafe.reference.rl.run import RunSettings, run_config
from rollsafe.reference.rl.servers import RunServers

RUN_ID = "runbench"
INSTANCES = tuple(f"w{n}" for n in range(8))  # --instances takes the first N
CHUNK = 512  # simulated groups handed out and dispatched per hold of the barrier
TICKS = os.sysconf("SC_CLK_TCK")
COUNTS = ("parked", "stragglers", "cut", "skipped", "failed", "committed_episodes")


class Workload:
    """Keeps ``groups`` groups generating on a thread of its own; records the sealed count."""

    def __init__(self, run: ReferenceController, groups: int) -> None:
        self.run, self.groups = run, groups
        self.size = run.state.config.group_size
        self.inflight: list[int] = []
        self.trained = self.steps = 0  # rollouts of the groups committed as trained; steps
        self.samples: list[tuple[float, int]] = [(time.perf_counter(), 0)]  # at each change
        self.error: BaseException | None = None
        self._ramp_until = self._ramp_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="workload", daemon=True)

    def start(self, ramp_s: float) -> None:
        """The first groups start one per ``ramp_s``: episodes of one length started together
        seal in lockstep bursts; staggered, they stay spread (each group takes as long)."""
        self._ramp_s = ramp_s
        self._ramp_until = time.perf_counter() + ramp_s * self.groups
        self._thread.start()

    def rate(self, t0: float, t1: float) -> tuple[int, float]:
        """Rollouts sealed, and seconds, between the first and the last change of the sealed
        count within ``[t0, t1]``: both ends at a seal, so no end cuts a gap between seals."""
        inside = [(t, n) for t, n in list(self.samples) if t0 <= t <= t1]
        if len(inside) < 2:
            raise RuntimeError(f"fewer than 2 seals in {t1 - t0:.0f}s: the workload is stuck")
        (ta, na), (tb, nb) = inside[0], inside[-1]
        return nb - na, tb - ta

    def halt(self) -> None:  # no new groups (the episodes in flight go on)
        self._stop.set()
        self._thread.join()

    def stop(self, timeout_s: float = 120.0) -> None:
        """No new groups; wait for the episodes in flight (their failure is raised)."""
        self.halt()
        if self.error is not None:
            raise self.error
        self.run.wait_episodes(timeout_s)

    def _pump(self) -> None:
        try:
            while not self._stop.is_set():
                self._top_up()
                ramping = time.perf_counter() < self._ramp_until
                self._stop.wait(self._ramp_s if ramping else 0.02)
        except BaseException as exc:  # raised in the main thread by window() or stop()
            self.error = exc

    def _top_up(self) -> None:
        run = self.run
        run.raise_failed()  # an episode's failure stops the workload
        with run.barrier:
            ctl = run.state
            sealed = self.trained + sum(ctl.index.sealed(idx) for idx in self.inflight)
            if sealed != self.samples[-1][1]:
                self.samples.append((time.perf_counter(), sealed))
            done = [idx for idx in self.inflight if ctl.index.state(idx) == GroupState.READY]
            if done:
                ctl.claim(done, self.steps)
                ctl.commit_step(done)
                self.steps += 1
                self.trained += len(done) * self.size
            fresh = self.groups - len(self.inflight) + len(done)
            if time.perf_counter() < self._ramp_until:
                fresh = min(fresh, 1)
            new = list(range(ctl.loader_position, ctl.loader_position + fresh))
            if new:
                ctl.handout(new)
            self.inflight = [idx for idx in self.inflight if idx not in done] + new
        if new:
            run.generate(new)


def simulate(run: ReferenceController, rollouts: int, owners: tuple[str, ...]) -> int:
    """Hand out ``rollouts // group_size`` groups and dispatch every sibling, no episodes."""
    size = run.state.config.group_size
    groups = rollouts // size
    for first in range(0, groups, CHUNK):
        with run.barrier:
            ctl = run.state
            start = ctl.loader_position
            block = list(range(start, start + min(CHUNK, groups - first)))
            ctl.handout(block)
            for idx in block:
                for i in range(size):
                    ctl.dispatch(idx, i, owners[(idx + i) % len(owners)])
    return groups * size


def snapshot(run: ReferenceController) -> dict[str, Any]:
    """The ten phases in process, as ``ReferenceRun.snapshot``; aborted if one fails."""
    spec = SnapshotSpec(run_id=RUN_ID, seq=run.next_seq())
    spans: dict[Phase, tuple[float, float]] = {}
    results = {}
    try:
        for phase in PHASES:
            t0 = time.perf_counter()
            results[phase] = run.run_phase(PhaseRequest(spec=spec, phase=phase))
            spans[phase] = (t0, time.perf_counter())
    except BaseException as exc:
        run.abort(spec)  # environments resumed, admission reopened
        if not isinstance(exc, TransientError):
            raise
        print(f"  snapshot {spec.seq} failed and was aborted: {exc}", flush=True)
        return {"error": str(exc)}  # counted: a supervisor retries it with the next seq
    published = results[Phase.PUBLISH].published
    assert published is not None
    files = [f for f in Path(published.path).rglob("*") if f.is_file()]
    counts = {k: v for p in PHASES for k, v in results[p].counts.items() if k in COUNTS}
    return {
        "park": spans[Phase.RESUME][1] - spans[Phase.CLOSE_ADMISSION][0],
        "total": spans[Phase.PUBLISH][1] - spans[Phase.OPEN][0],
        "phases": {str(p): b - a for p, (a, b) in spans.items()},
        "bytes": sum(f.stat().st_size for f in files),
        **counts,
    }


class Snapshots:
    """A thread taking a snapshot at ``interval / 2``, ``3 * interval / 2``, ... from now."""

    def __init__(self, run: ReferenceController, interval: float) -> None:
        self.run, self.interval = run, interval
        self.taken: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="snapshots", daemon=True)
        self._thread.start()

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.taken

    def _loop(self) -> None:
        due = time.perf_counter() + self.interval / 2
        try:
            while not self._stop.wait(max(0.0, due - time.perf_counter())):
                self.taken.append(snapshot(self.run))
                due += self.interval
        except BaseException as exc:  # raised by stop() in the main thread
            self.error = exc


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """CPU seconds used so far by ``pids`` (user + system), and by the whole machine."""
    ours = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ours += int(fields[11]) + int(fields[12])  # utime, stime
    total = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return ours / TICKS, (sum(total) - total[3] - total[4]) / TICKS  # busy: not idle, iowait


def window(work: Workload, args: argparse.Namespace, snapping: bool) -> dict[str, Any]:
    """Rollouts sealed in ``args.seconds``, with a snapshot thread running or not; CPU
    seconds used meanwhile by this run's processes and by everything else on the machine."""
    snapshots = Snapshots(work.run, args.interval) if snapping else None
    t0, (ours0, busy0) = time.perf_counter(), cpu_seconds(args.pids)
    time.sleep(args.seconds)
    t1, (ours1, busy1) = time.perf_counter(), cpu_seconds(args.pids)
    taken = snapshots.stop() if snapshots is not None else []
    if work.error is not None:
        raise work.error
    sealed, span = work.rate(t0, t1)
    rate, ours, seconds = sealed / span, ours1 - ours0, t1 - t0
    others = max(0.0, busy1 - busy0 - ours)  # ticks round: a quiet machine can read below 0
    return {"snapping": snapping, "sealed": sealed, "span": span, "rate": rate,
            "seconds": seconds, "cpu_per_rollout": ours / (rate * seconds),
            "others_cores": others / seconds, "snapshots": taken}  # fmt: skip


def measure(work: Workload, size: int, args: argparse.Namespace) -> dict[str, Any]:
    windows = []
    for r in range(args.rounds):
        for snapping in (r % 2 == 1, r % 2 == 0):
            w = window(work, args, snapping)
            windows.append(w)
            print(f"  round {r} {'with' if snapping else 'without'} snapshots: "
                  f"{w['rate']:.2f} rollouts/s, {w['cpu_per_rollout'] * 1e3:.0f} ms CPU per "
                  f"rollout; other load {w['others_cores']:.2f} cores", flush=True)  # fmt: skip
    on = [w for w in windows if w["snapping"]]
    off = [w for w in windows if not w["snapping"]]
    pairs = [b["rate"] / a["rate"] if b["snapping"] else a["rate"] / b["rate"]
             for a, b in zip(windows[::2], windows[1::2], strict=True)]  # fmt: skip
    same = [b["rate"] / a["rate"] for a, b in zip(windows[1::2], windows[2::2], strict=False)]
    taken = [s for w in on for s in w["snapshots"] if "error" not in s]
    # rollouts sealed / seconds between the first and the last seal, all windows of a mode
    off_rate, on_rate = (sum(w["sealed"] for w in g) / sum(w["span"] for w in g) for g in (off, on))
    row: dict[str, Any] = {"size": size, "off": off_rate, "on": on_rate}
    row["ratio"] = row["on"] / row["off"]
    row |= {"pair_min": min(pairs), "pair_med": statistics.median(pairs), "pair_max": max(pairs)}
    row |= {"pairs": pairs, "others": statistics.median(w["others_cores"] for w in windows)}
    row |= {"aa_min": min(same, default=1.0), "aa_max": max(same, default=1.0)}
    for mode, group in (("off", off), ("on", on)):
        row[f"cpu_{mode}"] = statistics.median(w["cpu_per_rollout"] for w in group)
    row["cpu_ratio"] = row["cpu_off"] / row["cpu_on"]
    row["snapshots"], row["failed"] = len(taken), sum(len(w["snapshots"]) for w in on) - len(taken)
    row["parked"] = sum(s["park"] for s in taken) / sum(w["seconds"] for w in on)
    if not taken:  # every snapshot failed: the failures are the result
        raise SystemExit(f"size {size}: no snapshot succeeded ({row['failed']} failed)")
    for key in ("park", "total"):
        values = [s[key] for s in taken]
        row[f"{key}_med"], row[f"{key}_max"] = statistics.median(values), max(values)
        row[f"{key}_p95"] = _p95(values)
    row["bytes"] = statistics.median(s["bytes"] for s in taken)
    row["phases"] = {p: statistics.median(s["phases"][p] for s in taken) for p in map(str, PHASES)}
    row |= {f"{k}_med": statistics.median(s.get(k, 0) for s in taken) for k in COUNTS}
    row["stragglers_max"] = max(s.get("stragglers", 0) for s in taken)
    return row | {"windows": windows}


def bench(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    settings = RunSettings(run_id=RUN_ID, group_size=args.group_size, turns=args.turns)
    logs, names, tokens = root / "logs", INSTANCES[: args.instances], args.max_tokens
    servers = RunServers(logs, names, seed=0, engine_token="e", env_token="v", max_tokens=tokens)
    try:
        endpoints = servers.start()
        started = cast("list[ServedProcess]", servers.started)  # no NeMo Gym: all served
        args.pids = [os.getpid(), *(server.proc.pid for server in started)]
        config, snaps = run_config(settings), root / "snapshots"
        run = ReferenceController(config, snaps, endpoints, args.turns, keep_latest_k=2)
        try:
            return _sizes(run, args)
        finally:
            run.close()
    finally:
        servers.stop()


def _sizes(run: ReferenceController, args: argparse.Namespace) -> list[dict[str, Any]]:
    work = Workload(run, args.groups)
    work.start(args.ramp)
    try:
        time.sleep(args.warmup)  # engine and servers warm, then one untimed snapshot
        snapshot(run)
        rows, simulated = [], 0
        for size in sorted(args.sizes):
            t0 = time.perf_counter()
            simulated += simulate(run, size - simulated, INSTANCES[: args.instances])
            took = time.perf_counter() - t0
            print(f"size {size:,}: {simulated:,} simulated rollouts ({took:.1f}s)", flush=True)
            rows.append(measure(work, size, args) | {"simulated": simulated})
    except BaseException:
        work.halt()
        raise
    work.stop()
    return rows


THROUGHPUT = (
    "size size ,d; off/s off .2f; on/s on .2f; ratio ratio .3f; pair_min pair_min .3f;"
    "pair_med pair_med .3f; pair_max pair_max .3f; A/A_min aa_min .3f; A/A_max aa_max .3f;"
    "others others .2f; cpu_off cpu_off .0f; cpu_on cpu_on .0f; cpu_ratio cpu_ratio .3f"
)
SNAPSHOTS = (
    "size size ,d; snapshots snapshots d; failed failed d; parked parked .2%;"
    "park_med park_med .0f; park_p95 park_p95 .0f; park_max park_max .0f;"
    "total_med total_med .0f;"
    "total_max total_max .0f; bytes bytes ,.0f"
)
MS = {"park_med", "park_p95", "park_max", "total_med", "total_max", "cpu_off", "cpu_on"}


def _p95(values: list[float]) -> float:
    """The 95th percentile (nearest rank): the max below 20 values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def table(rows: list[dict[str, Any]], spec: str) -> None:
    columns = [col.split() for col in spec.split(";")]
    print("".join(f"{head.replace('_', ' '):>12}" for head, _key, _fmt in columns))
    for row in rows:
        print("".join(f"{row[k] * (1e3 if k in MS else 1):>12{f}}" for _h, k, f in columns))


def report(rows: list[dict[str, Any]]) -> None:
    print("rollouts/s; ratios with / without; others: cores busy with other work; cpu ms/rollout")
    table(rows, THROUGHPUT)
    print("\nsnapshots: parked = share of the time admission was closed; park, total in ms")
    table(rows, SNAPSHOTS)
    names = [str(p) for p in PHASES]
    print("\nmedian ms per phase\n" + f"{'size':>8}" + "".join(f"{n[:11]:>12}" for n in names))
    for r in rows:
        print(f"{r['size']:>8,}" + "".join(f"{r['phases'][n] * 1e3:>12.1f}" for n in names))
    for r in rows:
        counts = ", ".join(f"{k} {r[f'{k}_med']:g}" for k in COUNTS)
        print(f"{r['size']:>8,} (medians): {counts}; stragglers max {r['stragglers_max']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,200000", help="simulated rollouts")
    parser.add_argument("--seconds", type=float, default=20.0, help="one window")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between snapshots")
    parser.add_argument("--rounds", type=int, default=5, help="window pairs per size")
    parser.add_argument("--groups", type=int, default=6, help="real groups kept generating")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per policy call")
    parser.add_argument("--instances", type=int, default=3, choices=range(1, len(INSTANCES) + 1))
    parser.add_argument(
        "--episodes", type=int, help="live episodes (parked at each snapshot): sets --groups"
    )
    parser.add_argument("--ramp", type=float, default=0.3, help="seconds between first groups")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring")
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="parent of the temp dir")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--quick", action="store_true", help="1k and 10k, 10 s windows, 1 round")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.episodes is not None:  # whole groups: at least the episodes asked for
        args.groups = max(1, math.ceil(args.episodes / args.group_size))
    if args.quick:
        args.sizes, args.seconds, args.interval, args.rounds = [1000, 10000], 10.0, 5.0, 1
    start = time.perf_counter()
    print(f"python {platform.python_version()}; cpus={os.cpu_count()}; {platform.platform()}")
    print(f"{args.instances} env servers, group size {args.group_size}, {args.groups} groups in "
          f"flight, {args.turns} turns x {args.max_tokens} tokens; windows {args.seconds:g}s x "
          f"{args.rounds} per mode; a snapshot every {args.interval:g}s", flush=True)  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix=".run-bench-", dir=args.dir))
    try:
        rows = bench(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        report(rows)
    print(f"\n{summary(rows, args.interval)}; wall {time.perf_counter() - start:.0f} s")


def summary(rows: list[dict[str, Any]], interval: float) -> str:
    """The target against the noise: every adjacent with/without pair, all sizes."""
    pairs = [p for r in rows for p in r["pairs"]]
    mean = statistics.mean(pairs)
    se = statistics.stdev(pairs) / len(pairs) ** 0.5 if len(pairs) > 1 else float("inf")
    verdict = "met" if mean - 2 * se >= 0.95 else "missed" if mean + 2 * se < 0.95 else None
    return (
        f"summary: throughput with a snapshot every {interval:g}s / without, mean of "
        f"{len(pairs)} adjacent pairs {mean:.3f} +- {se:.3f} (standard error); worst size "
        f"{min(r['ratio'] for r in rows):.3f}; target >= 0.95: "
        f"{verdict or 'not resolved (within 2 standard errors)'}"
    )


if __name__ == "__main__":
    main()
