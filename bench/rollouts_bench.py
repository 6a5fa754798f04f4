"""What the SDK for your own loop costs (docs/integrating.md), against baselines measured in
the same run.

    .venv/bin/python bench/rollouts_bench.py [--rollouts 2000] [--lags 40] [--steps 200]

1. **Bookkeeping per rollout** (dispatch + seal of a small row, a controller in this process):
   the controller's own calls (baseline) vs ``SyncRollouts`` vs ``Rollouts`` (asyncio, 32
   rollouts at a time, each call on a worker thread).
2. **Dispatch lag after a park**: how long after admission reopens a waiting dispatch
   returns: ``SyncRollouts`` waits on the gate itself; ``Rollouts`` asks again with a backoff
   capped at ``ADMISSION_RETRY_MAX_S``.
3. **A trainer step's notice** (``train_step_committed``) against a Temporal dev server:
   ``SyncCheckpointer`` (its own loop thread) vs ``Checkpointer`` (baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from rollsafe.checkpoint.controller import Controller
from rollsafe.client import Checkpointer, SyncCheckpointer
from rollsafe.core.config import RunConfig
from rollsafe.rollouts import ADMISSION_RETRY_MAX_S, Rollouts, SyncRollouts
from rollsafe.temporal.devserver import DevServer

ROW = {"tokens": np.arange(64, dtype=np.int32), "reward": np.array(1.0, np.float32)}


def controller(root: Path, rollouts: int, run_id: str = "bench") -> Controller:
    # What the SDK adds, not what durability costs (bench/journal_bench.py): journal off.
    config = RunConfig(run_id=run_id, group_size=8, groups_per_step=4, journal=False)
    made = Controller(config, root / run_id)
    made.handout(list(range(rollouts // 8)))
    return made


def per_rollout_direct(ctl: Controller, rollouts: int) -> float:
    start = time.perf_counter()
    for n in range(rollouts):
        episode = ctl.dispatch(n // 8, n % 8)
        assert episode is not None
        ctl.seal(n // 8, n % 8, episode.attempt, ROW)
    return (time.perf_counter() - start) / rollouts


def per_rollout_sync(ctl: Controller, rollouts: int) -> float:
    sdk = SyncRollouts(ctl)
    start = time.perf_counter()
    for n in range(rollouts):
        episode = sdk.dispatch(n // 8, n % 8)
        sdk.seal(n // 8, n % 8, episode.attempt, ROW)
    return (time.perf_counter() - start) / rollouts


def per_rollout_async(ctl: Controller, rollouts: int, concurrency: int = 32) -> float:
    sdk = Rollouts(ctl)

    async def one(n: int) -> None:
        episode = await sdk.dispatch(n // 8, n % 8)
        await sdk.seal(n // 8, n % 8, episode.attempt, ROW)

    async def all_of_them() -> None:
        for first in range(0, rollouts, concurrency):
            await asyncio.gather(
                *(one(n) for n in range(first, min(first + concurrency, rollouts)))
            )

    start = time.perf_counter()
    asyncio.run(all_of_them())
    return (time.perf_counter() - start) / rollouts


def lag(ctl: Controller, dispatch: Callable[[int, int], object], trials: int) -> list[float]:
    """Seconds from the gate's reopening to a waiting dispatch's return, per trial."""
    lags = []
    for trial in range(trials):
        cid = f"bench-{trial}"
        ctl.gate.close(cid)
        refused = ctl.gate.counters().refused
        done: list[float] = []
        waiter = threading.Thread(target=_dispatch_then_time, args=(dispatch, trial, done))
        waiter.start()
        while ctl.gate.counters().refused == refused:  # until the dispatch waits at the gate
            time.sleep(0.001)
        time.sleep(0.03)  # well into its wait (past the backoff's first tries)
        opened = time.perf_counter()
        ctl.gate.open(cid)
        waiter.join()
        lags.append(done[0] - opened)
    return lags


def _dispatch_then_time(dispatch: Callable[[int, int], object], n: int, done: list[float]) -> None:
    dispatch(n // 8, n % 8)
    done.append(time.perf_counter())


def ms(values: list[float]) -> str:
    return f"median {1000 * statistics.median(values):6.2f} ms, max {1000 * max(values):6.2f} ms"


async def notices(root: Path, steps: int) -> tuple[list[float], list[float]]:
    async with DevServer(root / "temporal") as server:
        run_async = Checkpointer("bench-async", connection=server.settings())
        await run_async.start()
        before = []
        for step in range(steps):
            start = time.perf_counter()
            await run_async.train_step_committed(step)
            before.append(time.perf_counter() - start)
        await run_async.stop()

        def sync_steps() -> list[float]:
            with SyncCheckpointer("bench-sync", connection=server.settings()) as run_sync:
                run_sync.start()
                seconds = []
                for step in range(steps):
                    start = time.perf_counter()
                    run_sync.train_step_committed(step)
                    seconds.append(time.perf_counter() - start)
                run_sync.stop()
                return seconds

        return before, await asyncio.to_thread(sync_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--lags", type=int, default=40)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        direct = per_rollout_direct(controller(root, args.rollouts, "direct"), args.rollouts)
        sync = per_rollout_sync(controller(root, args.rollouts, "sync"), args.rollouts)
        concurrent = per_rollout_async(controller(root, args.rollouts, "async"), args.rollouts)
        print(f"bookkeeping per rollout (dispatch + seal), {args.rollouts} rollouts:")
        print(f"  controller calls  {1e6 * direct:7.1f} us  (baseline)")
        print(f"  SyncRollouts      {1e6 * sync:7.1f} us  {sync / direct:5.2f}x")
        print(f"  Rollouts (async)  {1e6 * concurrent:7.1f} us  {concurrent / direct:5.2f}x")

        gated = controller(root, args.lags * 8, "lag-sync")
        sync_lags = lag(gated, SyncRollouts(gated).dispatch, args.lags)
        gated = controller(root, args.lags * 8, "lag-async")
        sdk = Rollouts(gated)
        async_lags = lag(gated, lambda g, i: asyncio.run(sdk.dispatch(g, i)), args.lags)
        print(f"dispatch lag after admission reopens, {args.lags} parks:")
        print(f"  SyncRollouts (waits on the gate)   {ms(sync_lags)}")
        print(f"  Rollouts (backoff to {1000 * ADMISSION_RETRY_MAX_S:g} ms)     {ms(async_lags)}")

        before, after = asyncio.run(notices(root, args.steps))
        ratio = statistics.median(after) / statistics.median(before)
        print(f"train_step_committed, {args.steps} steps:")
        print(f"  Checkpointer      {ms(before)}  (baseline)")
        print(f"  SyncCheckpointer  {ms(after)}  {ratio:5.2f}x")


if __name__ == "__main__":
    main()
