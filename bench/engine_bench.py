"""Cuts on the reference engine (MoE): latency, batched route reads, and decode under cuts.

    .venv/bin/python bench/engine_bench.py [--sizes 10,100,1000] [--repeats 3] [--quick]
    .venv/bin/python bench/engine_bench.py --backend vllm   (bench/engine_bench_vllm.py)

1. Cut latency: N calls in flight (8-token prompts, no stop tokens, a budget none exhausts),
   each with at least one token, then ``engine.cut(all_ids)`` timed: wall ms, hand-offs to the
   engine loop, and the frozen count the engine reports (``info().frozen``).
2. Batched route reads vs one call per hand-off: the same cut with ``batch_size=1`` against
   the default (``CUT_BATCH``), same engine, same calls, the order alternating per repeat; ratio
   = one-per-call ms / batched ms (and of the minima). A hand-off runs when the engine loop
   next checks its queue, which it does before each call's step.
3. Decode throughput: ``--calls`` calls generating; TokenEvents received over ``--window``
   seconds with no cut, and over the same window while a loop cuts-and-releases a rotating
   subset of ``SUBSET`` calls back to back (drawn from the first ``calls - OTHERS`` calls).
   The ``OTHERS`` last calls are never cut: their rate shows cuts do not stop them.

A fresh engine per repeat (sections 1-2), one engine for all repeats (section 3); medians.
``--quick``: sizes 10,100 and one repeat, whatever ``--sizes`` and ``--repeats`` say.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from typing import TYPE_CHECKING

import torch

from rollsafe.engine.model import ModelConfig
from rollsafe.engine.protocol import (
    CUT_BATCH,
    FinishEvent,
    GenerateRequest,
    SamplingParams,
    TokenEvent,
)
from rollsafe.engine.torch_engine import TorchEngine

CONFIG = ModelConfig(kind="moe")
PROMPT = 8
CUT_MAX_TOKENS = 400  # cut sections: calls live a few seconds at most
DECODE_MAX_TOKENS = 1000  # decode section: 8 + 1000 positions fit max_positions=1024
SUBSET = 64
OTHERS = 20
CUT_TABLE = (
    "calls n ,d; cut ms ms .2f; us/call us_per_call .1f; handoffs handoffs .0f; frozen frozen ,.0f"
)
ROUTE_TABLE = (
    "calls n ,d; batched ms ms .2f; handoffs handoffs .0f; one/call ms one_ms .2f;"
    "handoffs one_handoffs ,.0f; ratio ratio .1f; min ratio ratio_min .1f"
)


class Calls:
    """N calls on one engine, each stream read by a background task that counts tokens."""

    def __init__(self, engine: TorchEngine, n: int, max_tokens: int, tag: str) -> None:
        self.engine, self.n = engine, n
        self.ids = [f"{tag}-{i}" for i in range(n)]
        self.counts = [0] * n
        self.finished = 0
        self._ready = asyncio.Event()
        self._started = 0
        self.tasks = [asyncio.create_task(self._read(i, max_tokens)) for i in range(n)]

    async def _read(self, i: int, max_tokens: int) -> None:
        prompt = tuple((i * 7 + j * 13) % CONFIG.vocab_size for j in range(PROMPT))
        sampling = SamplingParams(seed=1000 + i, max_tokens=max_tokens)
        request = GenerateRequest(call_id=self.ids[i], prompt_tokens=prompt, sampling=sampling)
        async for event in self.engine.generate(request):
            if isinstance(event, TokenEvent):
                if self.counts[i] == 0:
                    self._started += 1
                    if self._started == self.n:
                        self._ready.set()
                self.counts[i] += 1
            elif isinstance(event, FinishEvent):
                self.finished += 1

    async def ready(self) -> None:
        await self._ready.wait()

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.finished:
            raise RuntimeError(f"{self.finished} calls finished during the measurement")


async def timed_cut(engine: TorchEngine, ids: list[str], batch: int) -> dict[str, float]:
    start = time.perf_counter()
    report = await engine.cut(ids, batch_size=batch)
    wall = time.perf_counter() - start
    frozen = (await engine.info()).frozen
    if len(report.prefixes) != len(ids) or report.refused or frozen != len(ids):
        raise RuntimeError(f"cut of {len(ids)}: {len(report.prefixes)} prefixes, {frozen} frozen")
    released = await engine.release(ids)
    if released != len(ids):
        raise RuntimeError(f"released {released} of {len(ids)}")
    return {"ms": wall * 1e3, "handoffs": report.handoffs, "frozen": frozen}


async def measure_cuts(n: int, repeats: int, batch: int) -> dict[str, float]:
    batched: list[dict[str, float]] = []
    single: list[dict[str, float]] = []
    for r in range(repeats):
        engine = TorchEngine(CONFIG, seed=0)
        calls = Calls(engine, n, CUT_MAX_TOKENS, f"n{n}r{r}")
        try:
            await calls.ready()
            await timed_cut(engine, calls.ids, batch)  # warm-up, untimed
            for size in (batch, 1) if r % 2 == 0 else (1, batch):
                (batched if size == batch else single).append(
                    await timed_cut(engine, calls.ids, size)
                )
            await calls.stop()
        finally:
            await engine.close()

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(run[key] for run in runs)

    row = {"n": n, "ms": med(batched, "ms"), "handoffs": med(batched, "handoffs")}
    row |= {"frozen": med(batched, "frozen"), "us_per_call": med(batched, "ms") * 1e3 / n}
    row |= {"one_ms": med(single, "ms"), "one_handoffs": med(single, "handoffs")}
    row["ratio_min"] = min(x["ms"] for x in single) / min(x["ms"] for x in batched)
    return row | {"ratio": row["one_ms"] / row["ms"]}


async def window(calls: Calls, seconds: float, others: range) -> tuple[float, float]:
    """Tokens/s of all calls and of ``others`` over ``seconds``."""
    before, start = list(calls.counts), time.perf_counter()
    await asyncio.sleep(seconds)
    after, wall = list(calls.counts), time.perf_counter() - start
    total = sum(after) - sum(before)
    other = sum(after[i] - before[i] for i in others)
    return total / wall, other / wall


async def cut_loop(
    engine: TorchEngine, pool: list[str], subset: int, batch: int, stop: asyncio.Event
) -> tuple[float, float]:
    """Cut ``subset`` calls of ``pool`` then release them, back to back, rotating.
    Returns (cuts per second, median ms per cut)."""
    offset, began, cut_ms = 0, time.perf_counter(), []
    while not stop.is_set():
        ids = [pool[(offset + k) % len(pool)] for k in range(subset)]
        start = time.perf_counter()
        await engine.cut(ids, batch_size=batch)
        cut_ms.append((time.perf_counter() - start) * 1e3)
        await engine.release(ids)
        offset = (offset + subset // 4) % len(pool)
    return len(cut_ms) / (time.perf_counter() - began), statistics.median(cut_ms)


async def measure_decode(n: int, repeats: int, seconds: float, batch: int) -> dict[str, float]:
    if n <= OTHERS + SUBSET // 2:
        raise SystemExit(f"--calls must exceed {OTHERS + SUBSET // 2}")
    pool, others = n - OTHERS, range(n - OTHERS, n)
    subset = min(SUBSET, pool)
    engine = TorchEngine(CONFIG, seed=0)
    calls = Calls(engine, n, DECODE_MAX_TOKENS, "decode")
    plain: list[tuple[float, float]] = []
    cutting: list[tuple[float, float]] = []
    cuts: list[tuple[float, float]] = []
    try:
        await calls.ready()
        await asyncio.sleep(0.5)  # warm-up: every call past its prompt, untimed
        for r in range(repeats):
            for with_cuts in (r % 2 == 1, r % 2 == 0):
                if not with_cuts:
                    plain.append(await window(calls, seconds, others))
                    continue
                stop = asyncio.Event()
                task = asyncio.create_task(cut_loop(engine, calls.ids[:pool], subset, batch, stop))
                cutting.append(await window(calls, seconds, others))
                stop.set()
                cuts.append(await task)
        if (await engine.info()).frozen:
            raise RuntimeError("calls left frozen after the cut loop")
        tokens = statistics.mean(calls.counts)
        await calls.stop()
    finally:
        await engine.close()
    p_all, p_oth = (statistics.median(x) for x in zip(*plain, strict=True))
    c_all, c_oth = (statistics.median(x) for x in zip(*cutting, strict=True))
    row = {"plain": p_all, "plain_others": p_oth, "cutting": c_all, "cutting_others": c_oth}
    row |= {"cuts_per_s": statistics.median(c for c, _ms in cuts), "ratio": c_all / p_all}
    row |= {"cut_ms": statistics.median(ms for _c, ms in cuts), "tokens": tokens}
    return row | {"ratio_others": c_oth / p_oth, "subset": subset, "others": len(others)}


def table(spec: str, rows: list[dict[str, float]]) -> None:
    """``spec``: "header key format" columns separated by ";"."""
    columns = [column.strip().rsplit(" ", 2) for column in spec.split(";")]
    print("".join(f"{head:>13}" for head, _key, _fmt in columns))
    for row in rows:
        print("".join(f"{row[key]:>13{fmt}}" for _head, key, fmt in columns))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000", help="in-flight call counts to cut")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=CUT_BATCH, help="calls per hand-off")
    parser.add_argument("--calls", type=int, default=100, help="calls in the decode section")
    parser.add_argument("--window", type=float, default=2.0, help="decode window, seconds")
    parser.add_argument("--quick", action="store_true", help="sizes 10,100 and one repeat")
    parser.add_argument("--backend", choices=("reference", "vllm"), default="reference")
    parser.add_argument("--model", help="vllm: a model directory (default: a tiny one built)")
    args = parser.parse_args()
    sizes = [10, 100] if args.quick else [int(s) for s in args.sizes.split(",")]
    repeats = 1 if args.quick else args.repeats
    if args.backend == "vllm":  # its own sections: bench/engine_bench_vllm.py
        if TYPE_CHECKING:  # mypy reads bench/ as a package; run, bench/ is on sys.path
            from bench.engine_bench_vllm import main as vllm_main
        else:
            from engine_bench_vllm import main as vllm_main

        await vllm_main(args.model, sizes, repeats, min(args.calls, 32))
        return
    began = time.perf_counter()
    print(
        f"torch {torch.__version__}; cpus={os.cpu_count()}; python {platform.python_version()}; "
        f"model moe (d={CONFIG.d_model}, layers={CONFIG.n_layers}, experts={CONFIG.n_experts}, "
        f"top_k={CONFIG.top_k}); repeats={repeats} (medians)"
    )
    rows = [await measure_cuts(n, repeats, args.batch) for n in sizes]
    print(f"\n1. cut latency, {args.batch} calls per hand-off (every call has >= 1 token)")
    table(CUT_TABLE, rows)
    print(f"\n2. batched route reads ({args.batch}/hand-off) vs one call per hand-off, same run")
    table(ROUTE_TABLE, rows)
    d = await measure_decode(args.calls, repeats, args.window, args.batch)
    print(
        f"\n3. decode, {args.calls} calls, {args.window:g} s windows; cut loop: {d['subset']} "
        f"calls cut ({args.batch}/hand-off) then released, back to back, rotating over the "
        f"first {args.calls - d['others']}; {d['others']} others never cut; "
        f"{d['tokens']:.0f} tokens/call at the end"
    )
    print(f"{'':>10}{'tokens/s':>13}{'others tok/s':>13}{'cuts/s':>13}{'ms/cut':>13}")
    print(f"{'no cut':>10}{d['plain']:>13,.0f}{d['plain_others']:>13,.0f}{0:>13.1f}{'-':>13}")
    print(
        f"{'cut loop':>10}{d['cutting']:>13,.0f}{d['cutting_others']:>13,.0f}"
        f"{d['cuts_per_s']:>13.1f}{d['cut_ms']:>13.2f}"
    )
    print(f"{'ratio':>10}{d['ratio']:>13.2f}{d['ratio_others']:>13.2f}")
    ratios = ", ".join(f"{r['n']:,}: {r['ratio']:.1f}x" for r in rows)
    print(
        f"\nsummary: one-per-call / batched cut latency {ratios}; decode tokens/s under the cut "
        f"loop / without {d['ratio']:.2f} (others {d['ratio_others']:.2f}); "
        f"wall {time.perf_counter() - began:.0f} s"
    )


if __name__ == "__main__":
    asyncio.run(main())
