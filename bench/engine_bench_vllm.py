"""Cuts on vLLM (``engine_bench.py --backend vllm``): cut latency, rollsafe's sampler against
vLLM's own, and resuming a call cut at 90 % against generating it again.

    .venv/bin/python bench/engine_bench.py --backend vllm [--model DIR] [--sizes 10,100,1000]

1. Cut latency: N calls in flight on one ``VllmEngine`` (8-token prompts, a budget none
   exhausts), each with at least one token, then ``engine.cut(all_ids)`` timed (wall ms,
   hand-offs), then released; medians over ``--repeats``.
2. Sampler overhead: one vLLM ``LLMEngine`` with rollsafe's sampler loaded; ``--calls`` calls of
   ``DECODE_TOKENS`` tokens at temperature 1 sampled three ways, each first in turn, over
   ``3 x --repeats`` rounds in the same process: by vLLM's own sampler without a seed (its
   fastest path), by vLLM's with a seed per request (reproducible, though not resumable), and by
   rollsafe's (``extra_args``). Decode tokens/s of each and the ratios (vLLM's / rollsafe's;
   the target is at most 1.10).
3. Resume vs regenerate: ``--calls`` calls of ``RESUME_TOKENS`` tokens, cut at 90 %, resumed
   from their records, against generating them from the prompt: wall seconds of each.

The model: a tiny one built with ``rollsafe engine make-model`` (dense, unless ``--model``).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rollsafe.engine.protocol import (
    GenerateRequest,
    PrefixRecord,
    SamplingParams,
    TokenEvent,
    completion_of,
)
from rollsafe.engine.vllm.engine import VllmEngine
from rollsafe.engine.vllm.models import make_model

PROMPT = 8
CUT_MAX_TOKENS = 400
DECODE_TOKENS = 128
RESUME_TOKENS = 200


def request(i: int, max_tokens: int, tag: str) -> GenerateRequest:
    prompt = tuple((i * 7 + j * 13) % 1000 for j in range(PROMPT))
    sampling = SamplingParams(seed=1000 + i, temperature=1.0, max_tokens=max_tokens)
    return GenerateRequest(call_id=f"{tag}-{i}", prompt_tokens=prompt, sampling=sampling)


async def measure_cut(engine: VllmEngine, n: int, repeats: int, tag: str) -> dict[str, float]:
    started = asyncio.Event()
    first = set()
    streams = []

    async def read(req: GenerateRequest) -> None:
        async for event in engine.generate(req):
            if isinstance(event, TokenEvent):
                first.add(req.call_id)
                if len(first) == n:
                    started.set()

    reqs = [request(i, CUT_MAX_TOKENS, tag) for i in range(n)]
    streams = [asyncio.create_task(read(r)) for r in reqs]
    await started.wait()
    ids = [r.call_id for r in reqs]
    runs = []
    for _ in range(repeats):
        begin = time.perf_counter()
        report = await engine.cut(ids)
        runs.append(((time.perf_counter() - begin) * 1e3, report.handoffs))
        if len(report.prefixes) != n:
            raise RuntimeError(f"cut {len(report.prefixes)} of {n}: {report.refused[:3]}")
        await engine.release(ids)
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    ms = statistics.median(r[0] for r in runs)
    return {"n": n, "ms": ms, "us_per_call": ms * 1e3 / n, "handoffs": runs[0][1]}


async def measure_sampler(model: Path, calls: int, repeats: int) -> dict[str, float]:
    """The sampler alone: the same LLMEngine, vLLM's sampling against rollsafe's."""
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    from rollsafe.engine.vllm.sampler import extra_args

    engine = VllmEngine(model)  # builds the LLMEngine with rollsafe's sampler loaded
    llm: Any = engine._llm  # this bench drives vLLM itself, below the engine loop

    def params(mode: str, i: int) -> Any:
        common = {"max_tokens": DECODE_TOKENS, "ignore_eos": True, "detokenize": False}
        if mode == "rollsafe":
            fields = extra_args(1000 + i, 1.0, 1.0, 0, None)
            return VllmParams(temperature=0.0, logprobs=0, extra_args=fields, **common)
        seed = 1000 + i if mode == "vllm_seeded" else None
        return VllmParams(temperature=1.0, seed=seed, logprobs=0, **common)

    def timed(mode: str, round_: int) -> float:
        for i in range(calls):
            prompt = TokensPrompt(prompt_token_ids=list(request(i, 1, "p").prompt_tokens))
            llm.add_request(f"s{round_}-{mode}-{i}", prompt, params(mode, i))
        begin = time.perf_counter()
        while llm.has_unfinished_requests():
            llm.step()
        return calls * DECODE_TOKENS / (time.perf_counter() - begin)

    modes = ("rollsafe", "vllm_seeded", "vllm")
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    try:
        for r in range(repeats):
            for mode in modes[r % 3 :] + modes[: r % 3]:  # each mode first in turn
                rates[mode].append(timed(mode, r))
    finally:
        await engine.close()
    median = {mode: statistics.median(values) for mode, values in rates.items()}
    return {
        **median,
        "ratio": median["vllm"] / median["rollsafe"],
        "ratio_seeded": median["vllm_seeded"] / median["rollsafe"],
    }


async def measure_resume(engine: VllmEngine, calls: int) -> dict[str, float]:
    reqs = [request(i, RESUME_TOKENS, "r") for i in range(calls)]

    async def run(req: GenerateRequest) -> Any:
        return completion_of(req.call_id, [e async for e in engine.generate(req)])

    begin = time.perf_counter()
    full = await asyncio.gather(*(run(r) for r in reqs))
    regenerate = time.perf_counter() - begin
    cut = int(RESUME_TOKENS * 0.9)
    records = [
        _record(engine, r, c.tokens[:cut], c.logprobs[:cut])
        for r, c in zip(reqs, full, strict=True)
    ]

    async def resume(req: GenerateRequest, prefix: PrefixRecord) -> Any:
        return completion_of(req.call_id, [e async for e in engine.resume(req, prefix)], prefix)

    begin = time.perf_counter()
    again = await asyncio.gather(*(resume(r, p) for r, p in zip(reqs, records, strict=True)))
    resumed = time.perf_counter() - begin
    if list(again) != list(full):
        raise RuntimeError("a resumed call differs from the uninterrupted one")
    return {"regenerate_s": regenerate, "resume_s": resumed, "ratio": regenerate / resumed}


def _record(engine: VllmEngine, req: GenerateRequest, tokens: Any, logprobs: Any) -> PrefixRecord:
    from rollsafe.engine.protocol import prompt_digest, seal_prefix

    return seal_prefix(
        call_id=req.call_id,
        model=engine.fingerprint,
        prompt_digest=prompt_digest(req.prompt_tokens),
        sampling=req.sampling,
        tokens=tuple(tokens),
        logprobs=tuple(logprobs),
        weight_versions=(0,) * len(tokens),
        routes=None,
    )


async def main(model: str | None, sizes: list[int], repeats: int, calls: int) -> None:
    began = time.perf_counter()
    directory = Path(model) if model else make_model(Path(tempfile.mkdtemp()) / "dense")
    print(f"vLLM engine, model {directory}; repeats={repeats} (medians)")

    async def cuts_and_resume() -> tuple[list[dict[str, float]], dict[str, float]]:
        engine = VllmEngine(directory, max_num_seqs=max(sizes), max_model_len=512)
        try:
            rows = [await measure_cut(engine, n, repeats, f"c{n}") for n in sizes]
            return rows, await measure_resume(engine, calls)
        finally:
            await engine.close()

    rows, resume = await cuts_and_resume()
    print("\n1. cut latency (every call has >= 1 token)")
    print(f"{'calls':>10}{'cut ms':>12}{'us/call':>12}{'handoffs':>10}")
    for row in rows:
        print(f"{row['n']:>10,}{row['ms']:>12.2f}{row['us_per_call']:>12.1f}{row['handoffs']:>10}")
    sampler = await measure_sampler(directory, calls, 3 * repeats)  # noisier: more rounds
    print(f"\n2. decode tokens/s, {calls} calls x {DECODE_TOKENS} tokens, same engine")
    print(
        f"   vLLM's sampler {sampler['vllm']:,.0f} (seeded per request "
        f"{sampler['vllm_seeded']:,.0f}); rollsafe's {sampler['rollsafe']:,.0f}\n"
        f"   overhead ratio {sampler['ratio']:.2f} against vLLM's fastest (target <= 1.10), "
        f"{sampler['ratio_seeded']:.2f} against its seeded sampling"
    )
    print(
        f"\n3. {calls} calls of {RESUME_TOKENS} tokens cut at 90 %: regenerate "
        f"{resume['regenerate_s']:.2f} s, resume {resume['resume_s']:.2f} s "
        f"({resume['ratio']:.1f}x faster)"
    )
    print(f"\nwall {time.perf_counter() - began:.0f} s")
