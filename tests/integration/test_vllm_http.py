"""vLLM behind ``rollsafe engine serve --backend vllm``: many calls cut at random points over
HTTP, the server SIGKILLed, a fresh server process started, every call resumed over HTTP with
exactly the tokens, logprobs, finish reasons and routes the uninterrupted calls made (dense and
MoE, float32). And bf16 weights pushed over HTTP serve what a model saved with them serves.
"""

from __future__ import annotations

import asyncio
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollsafe.engine.http import EngineClient
from rollsafe.engine.protocol import (
    GenerateRequest,
    PrefixRecord,
    SamplingParams,
)
from rollsafe.http.served import ENGINE_BANNER, ServedProcess, start_served
from rollsafe.testing.parity import completed, mismatches

TOKEN = "vllm-test-token"
LIMIT_S = 180
START_S = 240.0  # import vllm and load the model, on a busy 2-core machine


def serve(model: Path, logs: Path, kind: str, dtype: str = "float32") -> ServedProcess:
    args = ["engine", "serve", "--backend", "vllm", "--model", str(model), "--port", "0"]
    args += ["--dtype", dtype, "--max-model-len", "256"]
    env = {"ROLLSAFE_ENGINE_TOKEN": TOKEN}  # never in argv
    return start_served(args, ENGINE_BANNER.format(kind=kind), logs, env, timeout_s=START_S)


@pytest.fixture
def servers() -> Iterator[list[ServedProcess]]:
    """Every server a test starts, stopped by pid at the end, whatever happens."""
    started: list[ServedProcess] = []
    try:
        yield started
    finally:
        for server in started:
            server.stop()


def requests(n: int, seed: int) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [
        GenerateRequest(
            call_id=f"http-{i}",
            prompt_tokens=tuple(rng.randrange(1024) for _ in range(rng.randint(2, 30))),
            sampling=SamplingParams(
                seed=500 + i,
                temperature=rng.choice([0.0, 0.8, 1.0]),
                top_p=rng.choice([1.0, 0.9]),
                max_tokens=rng.randint(32, 64),
                stop_token_ids=(3,),
            ),
        )
        for i in range(n)
    ]


async def cut_after(
    client: EngineClient, request: GenerateRequest, count: int
) -> PrefixRecord | None:
    """Read ``count`` tokens of the call, cut it: its record (None if it finished first)."""
    stream = client.generate(request)
    seen = 0
    async for _ in stream:
        seen += 1
        if seen >= count:
            break
    report = await client.cut([request.call_id])
    await stream.aclose()  # type: ignore[attr-defined]
    return report.prefixes[0] if report.prefixes else None


@pytest.mark.parametrize("arch", ["dense", "moe"])
async def test_calls_cut_over_http_resume_exactly_on_a_fresh_server_after_sigkill(
    arch: str, tiny_models: dict[str, Path], tmp_path: Path, servers: list[ServedProcess]
) -> None:
    batch = requests(12, seed=len(arch))
    first = serve(tiny_models[arch], tmp_path / "first", arch)
    servers.append(first)
    async with asyncio.timeout(LIMIT_S), EngineClient(first.url, TOKEN, timeout=60) as client:
        reference = list(await asyncio.gather(*(completed(client, r) for r in batch)))
        rng = random.Random(9)
        cuts = await asyncio.gather(*(cut_after(client, r, rng.randint(1, 24)) for r in batch))
    prefixes = {p.call_id: p for p in cuts if p is not None}
    assert len(prefixes) >= len(batch) // 2, "most calls are cut mid-way"
    first.crash()  # SIGKILL: the frozen calls die with the process; the records live on
    fresh = serve(tiny_models[arch], tmp_path / "fresh", arch)
    servers.append(fresh)
    todo = [r for r in batch if r.call_id in prefixes]
    async with asyncio.timeout(LIMIT_S), EngineClient(fresh.url, TOKEN, timeout=60) as client:
        resumed = await asyncio.gather(*(completed(client, r, prefixes[r.call_id]) for r in todo))
    want = [c for c in reference if c.call_id in prefixes]
    assert mismatches(want, list(resumed)) == []
    if arch == "moe":
        assert all(c.routes is not None and len(c.routes) == len(c.tokens) for c in resumed)


async def test_bf16_weights_over_http_serve_what_a_model_saved_with_them_serves(
    tiny_models: dict[str, Path], tmp_path: Path, servers: list[ServedProcess]
) -> None:
    """New weights in bfloat16, pushed over HTTP to a bf16 server, then a call: the same
    tokens as a bf16 server started from a model directory holding those weights."""
    original = load_file(str(tiny_models["dense"] / "model.safetensors"))
    generator = torch.Generator().manual_seed(4)
    weights = {
        name: (t + 0.05 * torch.randn(t.shape, generator=generator)).to(torch.bfloat16)
        for name, t in original.items()
    }
    saved = tmp_path / "saved"
    shutil.copytree(tiny_models["dense"], saved)
    save_file(weights, str(saved / "model.safetensors"))
    (request,) = requests(1, seed=11)
    pushed_to = serve(tiny_models["dense"], tmp_path / "pushed", "dense", "bfloat16")
    servers.append(pushed_to)
    async with asyncio.timeout(LIMIT_S), EngineClient(pushed_to.url, TOKEN, timeout=60) as client:
        before = await completed(client, request)
        await client.update_weights(weights, 1)
        pushed = await completed(client, request)
        assert (await client.info()).weight_version == 1
    pushed_to.stop()
    started_with = serve(saved, tmp_path / "saved-server", "dense", "bfloat16")
    servers.append(started_with)
    async with (
        asyncio.timeout(LIMIT_S),
        EngineClient(started_with.url, TOKEN, timeout=60) as client,
    ):
        loaded = await completed(client, request)
    assert pushed.weight_versions == (1,) * len(pushed.tokens)
    assert pushed.logprobs != before.logprobs  # the new weights serve
    assert (pushed.tokens, pushed.logprobs) == (loaded.tokens, loaded.logprobs)
