"""Streamed model calls through the gateway, with the real ``openai`` client: text comes as the
engine makes it, and a stream a snapshot cuts goes on where it stopped.

Real processes: ``rollsafe engine serve --backend scripted`` (its reply token by token, held
after a few tokens for the calls a test names) and ``rollsafe gateway serve`` running
:mod:`rollsafe.testing.streaming_agent` (``openai.AsyncOpenAI``: chat completions with
``stream=True``, the Responses API through the SDK's ``responses.stream``, which checks the
events' order as it assembles them). Each test first runs the same task unheld: the text an
uninterrupted call streams.

- Chat, parked mid-stream: the held call's first tokens have reached the client while the call
  is still generating (live, not sent once done); a real checkpoint parks the episode there,
  the engine cuts the call, the episode is committed and resumed, the call is released, and the
  stream goes on from the token it stopped at: the client's text is the uninterrupted one.
- Responses, across a crash: the same, then every process is SIGKILLed and started afresh; the
  restore brings the episode back as attempt 1 and the agent runs again; its stream sends the
  staged prefix first, then the rest: the text and token ids are the uninterrupted call's.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from rollsafe.engine.http import EngineClient
from rollsafe.engine.loop import HOLD_ENV, HoldRule
from rollsafe.engine.vllm.models import ModelSpec, make_model
from rollsafe.env.client import EnvClient
from rollsafe.env.protocol import (
    CommitRequest,
    EpisodeRef,
    EpisodeResult,
    PrepareRequest,
    RestoreRequest,
    ResumeRequest,
    RunEpisode,
)
from rollsafe.gateway.serve import GATEWAY_BANNER
from rollsafe.http.bearer import ENGINE_TOKEN_ENV, ENV_TOKEN_ENV
from rollsafe.http.served import ENGINE_BANNER, ServedProcess, rollsafe_command
from rollsafe.testing.processes import Generation
from rollsafe.testing.waiting import eventually_async

ANSWER = "Streaming works: every token arrives as soon as the engine makes it, in order."
SCRIPT = {"format_version": 1, "rules": [{"when": "", "reply": ANSWER}]}
HELD_AFTER = 4
TOKENS = {ENGINE_TOKEN_ENV: "engine-secret", ENV_TOKEN_ENV: "env-secret"}
AGENT = "rollsafe.testing.streaming_agent:agent"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = ModelSpec(hidden_size=32, layers=1, heads=1, kv_heads=1, max_positions=32768)
    return make_model(tmp_path_factory.mktemp("stream-model") / "model", spec)


class Stack(Generation):
    """The engine (``hold``: holding calls whose id starts with ``held``) and the gateway."""

    def __init__(self, root: Path, model: Path, name: str, *, hold: bool = True) -> None:
        logs = root / "logs" / name
        script = root / "script.json"
        script.write_text(json.dumps(SCRIPT))
        env = dict(TOKENS)
        if hold:
            rule = HoldRule(calls="^held", after_tokens=HELD_AFTER, once=False)
            env[HOLD_ENV] = rule.model_dump_json()
        super().__init__()
        try:
            engine = ["engine", "serve", "--backend", "scripted", "--model", str(model)]
            self.engine = self._start(
                [*engine, "--script", str(script), "--port", "0"],
                logs / "engine",
                env,
                ENGINE_BANNER.format(kind=r"\S+"),
            )
            gateway = ["gateway", "serve", "--model", str(model), "--engine-url", self.engine.url]
            gateway += ["--agent", AGENT, "--port", "0", "--instance", "gw-s"]
            self.gateway = self._start(
                [*gateway, "--snapshot-root", str(root), "--lease-grace-s", "5"],
                logs / "gateway",
                TOKENS,
                GATEWAY_BANNER.format(instance="gw-s"),
            )
        except BaseException:
            self.stop()
            raise
        self.env = EnvClient(self.gateway.url, TOKENS[ENV_TOKEN_ENV])
        self.engine_client = EngineClient(self.engine.url, TOKENS[ENGINE_TOKEN_ENV])

    def _start(self, args: list[str], logs: Path, env: dict[str, str], banner: str) -> Any:
        process = ServedProcess(rollsafe_command(*args), logs, env)
        self.started.append(process)
        process.wait_listening(banner)
        return process

    async def held(self) -> bool:
        return (await self.engine_client.info()).held == 1


def _task(api: str, deltas: Path | None = None) -> dict[str, Any]:
    task: dict[str, Any] = {"api": api, "prompt": "Does streaming work?"}
    if deltas is not None:
        task["deltas"] = str(deltas)
    return task


def _streamed(deltas: Path) -> str:
    if not deltas.exists():
        return ""
    return "".join(json.loads(line) for line in deltas.read_text().splitlines())


async def _uninterrupted(stack: Stack, api: str) -> EpisodeResult:
    episode = EpisodeRef(rollout_id=f"free{api}-0_g0", attempt=0)
    result = await stack.env.run_episode(RunEpisode(episode=episode, task=_task(api)))
    agent = result.info["agent"]
    assert agent["text"] == ANSWER and agent["deltas"] > 1  # streamed in pieces, whole
    return result


async def _park_mid_stream(stack: Stack, episode: EpisodeRef, deltas: Path, dest: Path) -> Any:
    """Wait until the held call's first text has reached the client while the call is still
    generating; park the episode in a real checkpoint, cut the call, commit; the prefix."""
    await eventually_async(stack.held, what=f"the call held after {HELD_AFTER} tokens")
    await eventually_async(lambda: _streamed(deltas) != "", what="text streamed before the end")
    before = _streamed(deltas)
    assert ANSWER.startswith(before) and len(before) < len(ANSWER), before
    ck = f"ck-{episode.rollout_id}"
    parked = await stack.env.prepare(PrepareRequest(checkpoint_id=ck, deadline_ts=time.time() + 30))
    assert parked.ready and [p.activity for p in parked.parked] == ["generating"]
    call_id = parked.parked[0].model_call_id
    assert call_id is not None
    [prefix] = (await stack.engine_client.cut([call_id])).prefixes
    assert len(prefix.tokens) == HELD_AFTER
    await stack.env.commit(CommitRequest(checkpoint_id=ck, scope=(episode,), dest=str(dest)))
    return prefix


async def test_a_chat_stream_parked_by_a_checkpoint_goes_on_where_it_stopped(
    tmp_path: Path, model_dir: Path, stacks: list[Stack]
) -> None:
    stack = Stack(tmp_path, model_dir, "only")
    stacks.append(stack)
    fresh = await _uninterrupted(stack, "chat")

    episode, deltas = EpisodeRef(rollout_id="heldchat-0_g0", attempt=0), tmp_path / "deltas"
    running = asyncio.create_task(
        stack.env.run_episode(RunEpisode(episode=episode, task=_task("chat", deltas)))
    )
    prefix = await _park_mid_stream(stack, episode, deltas, tmp_path / "snap")
    cut_at = _streamed(deltas)
    await stack.env.resume(ResumeRequest(checkpoint_id=f"ck-{episode.rollout_id}"))
    assert await stack.engine_client.release([prefix.call_id]) == 1  # the run's resume does
    result = await running

    agent = result.info["agent"]
    assert agent["text"] == ANSWER and _streamed(deltas) == ANSWER
    assert _streamed(deltas).startswith(cut_at)  # nothing sent again, nothing lost
    assert agent["generation_token_ids"] == fresh.info["agent"]["generation_token_ids"]
    assert result.info["calls"][0]["resumed_tokens"] == 0  # released, not restored


async def test_a_responses_stream_cut_by_a_snapshot_resumes_after_a_crash(
    tmp_path: Path, model_dir: Path, stacks: list[Stack]
) -> None:
    first = Stack(tmp_path, model_dir, "first")
    stacks.append(first)
    fresh = await _uninterrupted(first, "responses")

    episode, deltas = EpisodeRef(rollout_id="heldresponses-0_g0", attempt=0), tmp_path / "deltas"
    running = asyncio.create_task(
        first.env.run_episode(RunEpisode(episode=episode, task=_task("responses", deltas)))
    )
    dest = tmp_path / "snap" / "envs" / "gw-s"
    prefix = await _park_mid_stream(first, episode, deltas, dest)
    first.crash()
    running.cancel()
    with pytest.raises((asyncio.CancelledError, Exception)):
        await running

    second = Stack(tmp_path, model_dir, "second", hold=False)
    stacks.append(second)
    restore = RestoreRequest(
        restore_id="rs-1",
        source_checkpoint_id=f"ck-{episode.rollout_id}",
        root=str(dest),
        scope=(episode,),
        prefixes={prefix.call_id: prefix.model_dump(mode="json")},
        deadline_ts=time.time() + 30,
    )
    assert (await second.env.restore(restore)).restored == (episode.next_attempt(),)
    await second.env.resume(ResumeRequest(checkpoint_id="rs-1"))
    again = tmp_path / "deltas-again"
    result = await second.env.run_episode(
        RunEpisode(episode=episode.next_attempt(), task=_task("responses", again))
    )

    agent = result.info["agent"]
    assert result.restored and result.info["calls"][0]["resumed_tokens"] == HELD_AFTER
    assert agent["text"] == agent["final"] == ANSWER and _streamed(again) == ANSWER
    assert agent["generation_token_ids"] == fresh.info["agent"]["generation_token_ids"]
