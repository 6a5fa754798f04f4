"""vLLM serving a tiny model through the gateway: the examples' plain ``openai``-client agent
runs a NeMo Gym workplace_assistant episode (the real resources server) against
``rollsafe engine serve --backend vllm`` behind ``rollsafe gateway serve``.

A tiny random model writes nonsense, so this shows the path, not a skill: the chat template
renders a 6,000-token prompt with 27 tools, vLLM generates, the gateway answers a chat
completion with the token ids and logprobs, and the episode's result carries them. The same
episode run again makes the same tokens (sampling is keyed by the rollout and the call, never
by a stateful generator); another rollout samples other tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollsafe.engine.text import ChatCodec
from rollsafe.engine.vllm.models import ModelSpec, make_model
from rollsafe.env.client import EnvClient
from rollsafe.env.protocol import EpisodeRef, RunEpisode
from rollsafe.gateway.serve import GATEWAY_BANNER
from rollsafe.gym.servers import WORKPLACE, GymServers, gym_python
from rollsafe.http.bearer import ENGINE_TOKEN_ENV, ENV_TOKEN_ENV
from rollsafe.http.served import ENGINE_BANNER, ServedProcess, rollsafe_command, start_served

pytest.importorskip("vllm")

TOKENS = {ENGINE_TOKEN_ENV: "engine-secret", ENV_TOKEN_ENV: "env-secret"}  # never in argv
CONTEXT = 8192  # the prompt is ~6,000 tokens: 27 tool schemas
START_S = 240.0  # import vllm and load the model, on a busy 2-core machine


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[str]:
    model = make_model(tmp_path / "model", ModelSpec(max_positions=CONTEXT))
    started: list[Any] = []
    try:
        args = ["engine", "serve", "--backend", "vllm", "--model", str(model), "--port", "0"]
        engine = start_served(
            [*args, "--max-model-len", str(CONTEXT)],
            ENGINE_BANNER.format(kind="dense"),
            tmp_path / "engine",
            TOKENS,
            timeout_s=START_S,
        )
        started.append(engine)
        gym = GymServers(tmp_path / "gym", agent=False)
        started.append(gym)
        gym.start()
        served = ServedProcess(
            rollsafe_command(
                "gateway", "serve", "--model", str(model), "--engine-url", engine.url,
                "--agent", "examples.openai_agent:agent",
                "--tool-server", f"workplace={gym.resources_url}",
                "--port", "0", "--instance", "gw-vllm",
            ),
            tmp_path / "gateway",
            TOKENS,
        )  # fmt: skip
        started.append(served)
        yield served.wait_listening(GATEWAY_BANNER.format(instance="gw-vllm")).url
    finally:
        for process in reversed(started):
            process.stop()


async def test_an_episode_through_the_gateway_on_vllm(gateway: str, tmp_path: Path) -> None:
    task = WORKPLACE.example_rows(gym_python())[0]
    codec = ChatCodec.load(tmp_path / "model")

    async def run(rollout_id: str) -> Any:
        async with EnvClient(gateway, TOKENS[ENV_TOKEN_ENV]) as env:
            episode = EpisodeRef(rollout_id=rollout_id, attempt=0)
            return await env.run_episode(RunEpisode(episode=episode, task=task))

    first = await run("vllm-0_g0")
    calls = first.info["calls"]
    assert calls and first.info["tool_calls"][0]["path"] == "/seed_session"
    assert first.info["tool_calls"][-1]["path"] == "/verify"
    prompt = codec.decode(calls[0]["prompt_token_ids"])
    assert prompt.startswith("<|im_start|>system") and "calendar_create_event" in prompt
    assert 5000 < len(calls[0]["prompt_token_ids"]) < CONTEXT
    for call in calls:
        assert call["generation_token_ids"]
        assert len(call["generation_log_probs"]) == len(call["generation_token_ids"])
        assert all(lp <= 0.0 for lp in call["generation_log_probs"])
    assert isinstance(first.reward, float)

    again = await run("vllm-0_g0")  # the same rollout: the same samples, token for token
    # The same tokens. Logprobs agree to ~1e-6, not bit for bit: the second run's 6,000-token
    # prompt comes from vLLM's prefix cache, the first's from a chunked prefill (measured:
    # -4.9569502 vs -4.9569473; docs/platform.md).
    for made, remade in zip(again.info["calls"], calls, strict=True):
        for field in ("prompt_token_ids", "generation_token_ids"):
            assert made[field] == remade[field]
        assert made["generation_log_probs"] == pytest.approx(
            remade["generation_log_probs"], abs=1e-4
        )
    other = await run("vllm-1_g0")
    assert other.info["calls"][0]["generation_token_ids"] != calls[0]["generation_token_ids"]
