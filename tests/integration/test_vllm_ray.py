"""vLLM as a Ray actor, through :class:`RayEngine`: calls cut through one actor resume exactly
(tokens, logprobs, routes) on a fresh actor after the first is killed, and weights in bf16
travel through Ray intact (a bf16 update serves what the same values in fp32 serve)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rollsafe.engine.protocol import (
    GenerateRequest,
    PrefixRecord,
    SamplingParams,
    TokenEvent,
)
from rollsafe.engine.ray_actor import RayEngine, vllm_engine_actor
from rollsafe.testing.parity import completed, mismatches

LIMIT_S = 240  # two vLLM start-ups in actor processes, on a busy 2-core machine


def requests(n: int) -> list[GenerateRequest]:
    rng = random.Random(3)
    return [
        GenerateRequest(
            call_id=f"ray-{i}",
            prompt_tokens=tuple(rng.randrange(1024) for _ in range(rng.randint(2, 20))),
            sampling=SamplingParams(seed=70 + i, temperature=1.0, top_p=0.9, max_tokens=40),
        )
        for i in range(n)
    ]


async def cut_after(engine: RayEngine, request: GenerateRequest, count: int) -> PrefixRecord:
    async for event in engine.generate(request):
        if isinstance(event, TokenEvent) and event.index == count - 1:
            break
    (prefix,) = (await engine.cut([request.call_id])).prefixes
    return prefix


def start(ray: Any, model: Path) -> tuple[Any, RayEngine]:
    handle = vllm_engine_actor().options(num_cpus=0).remote(str(model))
    return handle, RayEngine(handle)


async def test_calls_cut_through_an_actor_resume_exactly_on_a_fresh_actor(
    ray_session: Any, tiny_models: dict[str, Path]
) -> None:
    batch = requests(6)
    handle, first = start(ray_session, tiny_models["moe"])
    try:
        async with asyncio.timeout(LIMIT_S):
            reference = list(await asyncio.gather(*(completed(first, r) for r in batch)))
            prefixes = [await cut_after(first, r, 3 + 4 * i) for i, r in enumerate(batch)]
            assert (await first.info()).frozen == len(batch)
    finally:
        ray_session.kill(handle)  # as a crash would: the frozen calls die with the process
    handle, fresh = start(ray_session, tiny_models["moe"])
    try:
        async with asyncio.timeout(LIMIT_S):
            resumed = [await completed(fresh, r, p) for r, p in zip(batch, prefixes, strict=True)]
            assert mismatches(reference, resumed) == []
            assert all(c.routes is not None for c in resumed)

            # Weights through Ray: bf16, then the same values as fp32, serve the same.
            original = load_file(str(tiny_models["moe"] / "model.safetensors"))
            generator = torch.Generator().manual_seed(1)
            bf16 = {
                name: (t + 0.05 * torch.randn(t.shape, generator=generator)).to(torch.bfloat16)
                for name, t in original.items()
            }
            await fresh.update_weights(bf16, 1)
            one = await completed(fresh, batch[0])
            await fresh.update_weights({n: t.float() for n, t in bf16.items()}, 2)
            two = await completed(fresh, batch[0])
            assert one.weight_versions == (1,) * len(one.tokens)
            assert two.weight_versions == (2,) * len(two.tokens)
            assert one.logprobs != reference[0].logprobs  # the new weights serve
            assert (one.tokens, one.logprobs, one.routes) == (two.tokens, two.logprobs, two.routes)
            assert (await fresh.info()).weight_version == 2
            await fresh.close()
    finally:
        ray_session.kill(handle)
