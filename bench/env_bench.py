"""Environment checkpoint toolkit: park window at 10k live episodes, and the drain's lookup cost.

    .venv/bin/python bench/env_bench.py [--episodes 10000] [--instances 4] [--repeats 3] [--quick]

1. Park window, in process: ``--instances`` :class:`Participant` s, each with a calendar-like
   environment holding ``episodes / instances`` live episodes (``participant.run`` tasks). An
   episode's turn is one boundary (``session.boundary``) and then one wait on its instance's
   turn gate (the model + tool calls of a turn, modelled as one await). Timed, all instances
   at once: *prepare* (from the calls until every reply: admission closes, the gates open, each
   episode finishes its turn and parks at its next boundary); *commit* of every parked episode
   into a fresh directory (export + ``store.write_records``: hash, fsync, rename, manifest);
   *resume*. Requests are built before the clock starts. Bytes = the records files.
   Baseline, same directory, same run, order alternating per repeat: one plain file holding
   the same bytes, written sequentially and fsynced (and its directory): ``w ratio`` = plain
   write s / commit s, the fraction of the disk's own speed the commit reaches.
2. Drain lookup: a :class:`PendingReplies` with ``--pending`` replies on the wire (half of them
   in the commit scope) beside a dispatcher's live-episode dict of each ``--live`` size. Timed
   (median of ``--reps`` calls): ``outside(scope)``, and a naive scan of the live dict for
   entries on the wire and outside the scope (what a drain without the record would do). Both
   must return the same episodes.

``--quick``: 1,000 episodes, one repeat, 200 repetitions of the lookup.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollsafe.env import protocol as wire
from rollsafe.env.drain import PendingReplies
from rollsafe.env.hooks import EnvironmentHooks, EpisodeSession
from rollsafe.env.participant import Participant
from rollsafe.env.protocol import EpisodeRef, EpisodeResult, RunEpisode

if TYPE_CHECKING:  # mypy reads bench/ as a package; run, bench/ is on sys.path
    from bench.snapshot_bench import baseline_write
else:
    from snapshot_bench import baseline_write  # the same plain write + fsync baseline

GROUP = 8


def ref(i: int) -> EpisodeRef:
    return EpisodeRef(rollout_id=f"bench-{i // GROUP}_g{i % GROUP}", attempt=0)


def calendar(i: int) -> dict[str, Any]:
    """A few hundred bytes of JSON: what a calendar-booking episode carries between turns."""
    day = 1 + i % 28
    return {
        "turn": 0,
        "tz": "Europe/Paris",
        "user": f"user-{i:06d}@example.org",
        "events": [
            {"title": "standup", "start": f"2025-03-{day:02d}T09:00", "minutes": 15},
            {"title": "review", "start": f"2025-03-{day:02d}T14:30", "minutes": 60},
        ],
        "pending": {"title": "1:1", "attendees": [f"peer-{i % 97}", f"lead-{i % 13}"]},
        "history": ["list_events", "find_slot"],
    }


class Calendar(EnvironmentHooks):
    name = "calendar"

    def __init__(self) -> None:
        self.state: dict[str, dict[str, Any]] = {}
        self.gate = asyncio.Event()  # the rest of a turn; set to let every episode take one
        self.started = 0

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        state = self.state[run.episode.key] = dict(run.task)
        self.started += 1
        while True:
            await session.boundary(state["turn"])
            await self.gate.wait()
            state["turn"] += 1

    def export_episode(self, episode: EpisodeRef) -> dict[str, Any]:
        return self.state[episode.key]

    def restore_episode(self, episode: EpisodeRef, record: dict[str, Any]) -> None:
        self.state[episode.next_attempt().key] = record

    def drop_episode(self, episode: EpisodeRef) -> None:
        self.state.pop(episode.key, None)


async def cycle(
    parts: list[Participant], envs: list[Calendar], dest: Path, cid: str
) -> dict[str, Any]:
    """One prepare + commit + resume of every instance at once; seconds per phase, bytes."""
    prepare = wire.PrepareRequest(checkpoint_id=cid, deadline_ts=time.time() + 300)
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(p.prepare(prepare)) for p in parts]
    await asyncio.sleep(0)  # every prepare has closed admission ...
    for env in envs:
        env.gate.set()  # ... before the episodes move on to their next boundary
    prepared = await asyncio.gather(*tasks)
    t1 = time.perf_counter()
    for env in envs:
        env.gate.clear()  # after resume, episodes wait at their gate again
    if not all(r.ready and not r.restarts for r in prepared):
        raise RuntimeError(f"{cid}: not every instance parked every episode")
    commits = [
        wire.CommitRequest(
            checkpoint_id=cid, scope=tuple(p.episode for p in r.parked), dest=str(dest / p.instance)
        )
        for p, r in zip(parts, prepared, strict=True)
    ]
    t2 = time.perf_counter()
    committed = await asyncio.gather(*(p.commit(c) for p, c in zip(parts, commits, strict=True)))
    t3 = time.perf_counter()
    await asyncio.gather(*(p.resume(wire.ResumeRequest(checkpoint_id=cid)) for p in parts))
    t4 = time.perf_counter()
    files = [
        dest / p.instance / m.file
        for p, r in zip(parts, committed, strict=True)
        for m in r.participants
    ]
    records = sum(m.records for r in committed for m in r.participants)
    nbytes = sum(f.stat().st_size for f in files)
    phases = {"prepare": t1 - t0, "commit": t3 - t2, "resume": t4 - t3}
    return phases | {"records": records, "bytes": nbytes, "files": files}


async def park_window(episodes: int, instances: int, repeats: int, root: Path) -> dict[str, Any]:
    envs = [Calendar() for _ in range(instances)]
    parts = [Participant(f"env-{i}", env) for i, env in enumerate(envs)]
    runs = [
        asyncio.create_task(parts[i % instances].run(RunEpisode(episode=ref(i), task=calendar(i))))
        for i in range(episodes)
    ]
    while sum(env.started for env in envs) < episodes:  # noqa: ASYNC110 - yields to the runs
        await asyncio.sleep(0)
    cycle_runs: list[dict[str, Any]] = []
    plain: list[float] = []
    try:
        for r in range(-1, repeats):  # r == -1: warm-up, untimed
            for real in (r % 2 == 1, r % 2 == 0):
                os.sync()  # untimed: no dirty pages queued before a measurement
                if real:
                    out = await cycle(parts, envs, root / f"ckpt-{r + 1}", f"bench-{r + 1}")
                    if out["records"] != episodes:
                        raise RuntimeError(f"committed {out['records']} of {episodes}")
                    data = memoryview(b"".join(f.read_bytes() for f in out.pop("files")))
                    if r >= 0:
                        cycle_runs.append(out)
                elif r >= 0:
                    path = root / f"plain-{r}"
                    plain.append(baseline_write(path, data))
                    path.unlink()
    finally:
        for task in runs:
            task.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
    row: dict[str, Any] = {"episodes": episodes, "instances": instances}
    for phase in ("prepare", "commit", "resume"):
        row[phase] = statistics.median(c[phase] for c in cycle_runs)
    row["window"] = row["prepare"] + row["commit"] + row["resume"]
    row["bytes"] = cycle_runs[-1]["bytes"]
    row["bytes_per_rec"] = row["bytes"] / episodes
    row["rec_per_s"] = episodes / row["commit"]
    row["plain"] = statistics.median(plain)
    row["w_ratio"] = row["plain"] / row["commit"]
    return row


@dataclass(slots=True)
class Live:
    """An entry of the dispatcher's live-episode dict: what a scan touches."""

    ref: EpisodeRef
    instance: str
    on_wire: bool


def median_ns(fn: Any, reps: int) -> float:
    """Median ns of ``reps`` calls, after ``reps // 10`` untimed ones; no GC meanwhile."""
    for _ in range(reps // 10):
        fn()
    times = []
    gc.disable()
    try:
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
    finally:
        gc.enable()
    return statistics.median(times)


def drain_lookup(live_n: int, pending_n: int, reps: int) -> dict[str, Any]:
    live = {(r := ref(i)).key: Live(r, f"env-{i % 4}", False) for i in range(live_n)}
    replies = PendingReplies()
    step = live_n // pending_n
    on_wire = [key for i, key in enumerate(live) if i % step == 0][:pending_n]
    for key in on_wire:
        live[key].on_wire = True
        replies.add(live[key].ref, live[key].instance)
    outside = set(on_wire[::2])
    scope = frozenset(live.keys() - outside)  # what prepare parked: all the rest

    def scan() -> list[EpisodeRef]:
        return [e.ref for k, e in live.items() if e.on_wire and k not in scope]

    if sorted(r.key for r in replies.outside(scope)) != sorted(r.key for r in scan()):
        raise RuntimeError("the keyed check and the scan disagree")
    keyed = median_ns(lambda: replies.outside(scope), reps)
    scanned = median_ns(scan, max(5, reps // 20))
    row = {"live": live_n, "pending": pending_n, "outside": len(outside)}
    return row | {"keyed_us": keyed / 1e3, "scan_us": scanned / 1e3}


def table(rows: list[dict[str, Any]], spec: str) -> None:
    """``spec``: "header key format; ..." (the header's words joined by _)."""
    columns = [col.split() for col in spec.split(";")]
    print("".join(f"{head.replace('_', ' '):>12}" for head, _key, _fmt in columns))
    for row in rows:
        print("".join(f"{row[key]:>12{fmt}}" for _head, key, fmt in columns))


PARK = (
    "episodes episodes ,d; instances instances d; prepare_ms prepare .1f; commit_ms commit .1f;"
    "resume_ms resume .1f; window_ms window .1f; bytes bytes ,d; B/record bytes_per_rec .0f;"
    "records/s rec_per_s ,.0f; plain_ms plain .1f; w_ratio w_ratio .2f"
)
DRAIN = (
    "live live ,d; pending pending d; outside outside d; "
    "keyed_us keyed_us .2f; scan_us scan_us ,.1f"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=10_000, help="live episodes in all")
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="park-window cycles (medians)")
    parser.add_argument("--live", default="10000,200000", help="live-dict sizes (drain)")
    parser.add_argument("--pending", type=int, default=100, help="replies on the wire (drain)")
    parser.add_argument("--reps", type=int, default=2000, help="drain lookups timed per size")
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="parent of the temp dir")
    parser.add_argument("--quick", action="store_true", help="1,000 episodes, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.repeats, args.reps = 1000, 1, 200
    sizes = [int(s) for s in args.live.split(",")]
    start = time.perf_counter()
    print(f"python {platform.python_version()}; cpus={os.cpu_count()}; {platform.platform()}")
    print(f"dir={args.dir}; repeats={args.repeats} (medians; ms = per cycle, all instances)")
    root = Path(tempfile.mkdtemp(prefix=".env-bench-", dir=args.dir))
    try:
        park = asyncio.run(park_window(args.episodes, args.instances, args.repeats, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n1. park window: prepare + commit + resume, every instance at once")
    ms = ("prepare", "commit", "resume", "window", "plain")
    table([{k: v * 1e3 if k in ms else v for k, v in park.items()}], PARK)
    drains = [drain_lookup(n, args.pending, args.reps) for n in sizes]
    print("\n2. drain lookup: outside(scope) over pending vs a scan of the live dict (median)")
    table(drains, DRAIN)
    first, last = drains[0], drains[-1]
    keyed_ratio = last["keyed_us"] / first["keyed_us"]
    scan_ratio = last["scan_us"] / first["scan_us"]
    print(
        f"ratio {last['live']:,}/{first['live']:,}: keyed {keyed_ratio:.2f}, scan {scan_ratio:.1f}"
    )
    grow = last["live"] / first["live"]
    print(
        f"\nsummary: {park['episodes']:,} episodes on {park['instances']} instances parked, "
        f"committed and resumed in {park['window'] * 1e3:.0f} ms (commit "
        f"{park['rec_per_s']:,.0f} records/s, {park['w_ratio']:.2f} of a plain write); "
        f"{grow:.0f}x the live episodes costs the drain check x{keyed_ratio:.2f} keyed, "
        f"x{scan_ratio:.1f} as a scan; wall {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
