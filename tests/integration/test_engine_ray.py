"""The reference engine as a Ray actor: same tokens as in process, cuts and resume through it."""

from __future__ import annotations

import asyncio
from typing import Any

from rollsafe.engine.loop import HOLD_ENV, HoldRule
from rollsafe.engine.model import ModelConfig
from rollsafe.engine.protocol import (
    GenerateRequest,
    SamplingParams,
    TokenEvent,
    completion_of,
)
from rollsafe.engine.ray_actor import EngineActor, RayEngine
from rollsafe.engine.torch_engine import TorchEngine
from rollsafe.testing.parity import completed

CONFIG = ModelConfig(kind="moe")


def request(i: int) -> GenerateRequest:
    return GenerateRequest(
        call_id=f"ray-{i}",
        prompt_tokens=(7, 8, 9 + i),
        sampling=SamplingParams(seed=i, temperature=1.0, max_tokens=20),
    )


async def test_actor_streams_cuts_and_resumes_like_the_engine_in_process(ray_session: Any) -> None:
    batch = [request(i) for i in range(4)]
    async with TorchEngine(CONFIG, 3) as local:
        expected = await asyncio.gather(*(completed(local, r) for r in batch))

    cut_me = request(9)
    # The call to cut stops after 5 tokens until the cut: it cannot finish first, however slow
    # the machine (the actor's process reads the hold from its environment).
    hold = HoldRule(calls=f"^{cut_me.call_id}$", after_tokens=5).model_dump_json()
    handle = EngineActor.options(runtime_env={"env_vars": {HOLD_ENV: hold}}).remote(CONFIG, 3)
    try:
        remote = RayEngine(handle)
        assert list(await asyncio.gather(*(completed(remote, r) for r in batch))) == expected

        # Cut a call mid-stream through the actor, resume it on a fresh local engine.
        async with TorchEngine(CONFIG, 3) as local:
            uninterrupted = await completed(local, cut_me)
        stream = remote.generate(cut_me)  # kept: a stream let go of frees its call
        async for event in stream:
            if isinstance(event, TokenEvent) and event.index == 4:
                break
        report = await remote.cut([cut_me.call_id])
        (prefix,) = report.prefixes
        assert len(prefix.tokens) >= 5 and report.handoffs == 1
        assert (await remote.info()).frozen == 1
        async with TorchEngine(CONFIG, 3) as fresh:
            events = [e async for e in fresh.resume(cut_me, prefix)]
        assert completion_of(cut_me.call_id, events, prefix) == uninterrupted
        await stream.aclose()  # type: ignore[attr-defined]
    finally:
        await handle.close.remote()  # type: ignore[attr-defined]  # ray: no .remote in its types
        ray_session.kill(handle)
