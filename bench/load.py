"""Load (issue 22, part 6): eight environment instances, ``--episodes`` live episodes, a
snapshot every ``--interval`` seconds for ``--minutes``; reports the invariant violations (must
be 0), the RSS of every process (engine, each environment server, this one) at the start and
the end with the ratio, and the data plane's rows and the snapshot store's files at both.

    .venv/bin/python bench/load.py [--episodes 1000] [--instances 8] [--interval 5]
                                   [--minutes 10] [--json]

Real servers (``RunServers``: the reference engine and workplace environments) and a
``ReferenceController`` in this process with its journal; the workload of
``bench/run_bench.py`` keeps ``--episodes / --group-size`` groups generating (sealed groups
committed as trained, no optimizer), so about ``--episodes`` episodes are live at any time.
Snapshots run the ten phases in process (as ``run_bench``), two retained. "Start" is taken once
the live episodes first reach 90 % of ``--episodes`` (or after ``--warmup-max`` seconds):
from then on, the memory of a process that leaks grows with the snapshots taken, and rows or
files that are never let go grow with the rollouts trained. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from rollsafe.core.run_state import ROLLOUT_PARTITION
from rollsafe.errors import InvariantError
from rollsafe.http.served import ServedProcess
from rollsafe.reference.rl.controller import ReferenceController
from rollsafe.reference.rl.run import RunSettings, run_config
from rollsafe.reference.rl.servers import RunServers

sys.path.insert(0, str(Path(__file__).parent))
if TYPE_CHECKING:  # mypy reads bench/ as a package; run, bench/ is on sys.path
    from bench.run_bench import RUN_ID, Workload, snapshot
else:
    from run_bench import RUN_ID, Workload, snapshot  # a sibling script, not a package

INSTANCES = tuple(f"w{n}" for n in range(8))
KEEP = 2  # snapshots retained


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def files_under(root: Path) -> tuple[int, int]:
    found = [p for p in root.rglob("*") if p.is_file()]
    return len(found), sum(p.stat().st_size for p in found)


def picture(run: ReferenceController, pids: dict[str, int], root: Path) -> dict[str, Any]:
    with run.barrier:
        rows = run.state.dataplane.count(ROLLOUT_PARTITION)
    files, size = files_under(root)
    return {
        "at_s": time.monotonic(),
        "live": len(run.participants.pending) if run.participants is not None else 0,
        "rss_mb": {name: rss_mb(pid) for name, pid in pids.items()},
        "rows": rows,
        "files": files,
        "bytes": size,
    }


def load(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    settings = RunSettings(run_id=RUN_ID, group_size=args.group_size, turns=args.turns)
    names = INSTANCES[: args.instances]
    servers = RunServers(
        root / "logs", names, seed=0, engine_token="e", env_token="v", max_tokens=args.max_tokens
    )
    try:
        endpoints = servers.start()
        pids = {"bench": os.getpid()}
        started = cast("list[ServedProcess]", servers.started)  # no NeMo Gym: all served
        pids |= {Path(s.out).parent.name: s.proc.pid for s in started}
        snaps = root / "snapshots"
        run = ReferenceController(
            run_config(settings), snaps, endpoints, args.turns, keep_latest_k=KEEP
        )
        try:
            return _run(run, args, pids, snaps)
        finally:
            run.close()
    finally:
        servers.stop()


def _run(
    run: ReferenceController, args: argparse.Namespace, pids: dict[str, int], snaps: Path
) -> dict[str, Any]:
    assert run.participants is not None
    work = Workload(run, args.episodes // args.group_size)
    work.start(args.ramp)
    try:
        deadline = time.monotonic() + args.warmup_max
        while time.monotonic() < deadline and len(run.participants.pending) < 0.9 * args.episodes:
            time.sleep(0.5)
        taken: list[dict[str, Any]] = []
        violations: list[str] = []
        failed, samples = 0, []
        end_at, due = time.monotonic() + args.minutes * 60, time.monotonic()
        while time.monotonic() < end_at:
            time.sleep(max(0.0, due - time.monotonic()))
            due += args.interval
            if work.error is not None:
                raise work.error
            try:
                result = snapshot(run)
            except InvariantError as exc:
                violations.append(str(exc))
                print(f"  INVARIANT VIOLATION: {exc}", flush=True)
                continue
            if "error" in result:
                failed += 1
                continue
            taken.append(result)
            # The start: once retention holds as many snapshots as it ever will.
            if len(taken) == KEEP + 1 or len(taken) % 12 == 0:
                samples.append(picture(run, pids, snaps))
                park = statistics.median(s["park"] for s in taken) * 1e3
                print(f"  {len(taken)} snapshots, {samples[-1]['live']} live, rows "
                      f"{samples[-1]['rows']}, files {samples[-1]['files']}, park median "
                      f"{park:.0f} ms", flush=True)  # fmt: skip
        end = picture(run, pids, snaps)
    except BaseException:
        work.halt()
        raise
    work.halt()
    verified = len(run.store.list(verify=True))
    return {
        "args": {k: v for k, v in vars(args).items() if k != "dir"},
        "start": samples[0] if samples else end,
        "end": end,
        "samples": samples,
        "snapshots": len(taken),
        "failed": failed,
        "violations": violations,
        "verified_snapshots": verified,
        "rollouts_trained": work.trained,
        "parked_median": statistics.median(s.get("parked", 0) for s in taken) if taken else 0,
        "park_ms_median": statistics.median(s["park"] for s in taken) * 1e3 if taken else 0,
        "park_ms_max": max(s["park"] for s in taken) * 1e3 if taken else 0,
    }


def report(result: dict[str, Any]) -> None:
    start, end = result["start"], result["end"]
    minutes = (end["at_s"] - start["at_s"]) / 60
    print(f"\n{result['snapshots']} snapshots in {minutes:.1f} min ({result['failed']} failed, "
          f"transient), {len(result['violations'])} invariant violations; "
          f"{result['verified_snapshots']} retained snapshots verify; "
          f"{result['rollouts_trained']} rollouts trained")  # fmt: skip
    print(f"live episodes: {start['live']} at the start, {end['live']} at the end; parked per "
          f"snapshot (median) {result['parked_median']:.0f}; park median "
          f"{result['park_ms_median']:.0f} ms, max {result['park_ms_max']:.0f} ms")  # fmt: skip
    print(f"data-plane rows: {start['rows']} -> {end['rows']}; snapshot store: "
          f"{start['files']} -> {end['files']} files, {start['bytes'] / 1e6:.1f} -> "
          f"{end['bytes'] / 1e6:.1f} MB")  # fmt: skip
    print("\n| process | RSS start (MB) | RSS end (MB) | end / start |\n|---|---:|---:|---:|")
    for name, before in start["rss_mb"].items():
        after = end["rss_mb"][name]
        print(f"| {name} | {before:.0f} | {after:.0f} | {after / before:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1000, help="live episodes kept")
    parser.add_argument("--instances", type=int, default=8, choices=range(1, len(INSTANCES) + 1))
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between snapshots")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per policy call")
    parser.add_argument("--ramp", type=float, default=0.01, help="seconds between first groups")
    parser.add_argument("--warmup-max", type=float, default=180.0)
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="parent of the temp dir")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rollsafe-load-", dir=args.dir))
    try:
        result = load(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        report(result)
    if result["violations"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
