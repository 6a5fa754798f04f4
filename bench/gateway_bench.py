"""The gateway: its overhead per call, a session replayed from its record, the park window.

    .venv/bin/python bench/gateway_bench.py [--calls 20] [--max-tokens 64] [--sessions 64]

Real processes: ``rollsafe engine serve`` (the reference engine, from a model directory made
here) and ``rollsafe gateway serve --agent bench.gateway_bench:agent``, whose agent is a plain
``openai`` client making ``task["calls"]`` chat completions (the same messages each time,
``max_tokens`` each, stop tokens on) and timing each one.

1. Overhead per call: the agent's calls through the gateway (HTTP, chat template, tokenizer,
   the session's record) against the same calls (the same prompt tokens, seeds and call ids:
   the same tokens) made by this process on the engine protocol (``EngineClient.generate``).
   Alternating order, ``--repeats`` times; ratio = gateway s / engine s (target <= 1.10).
2. Replay: a session of ``--calls`` + 1 calls, parked by a checkpoint while its last call
   generates (the engine holds it), committed, retired, restored as attempt 1 and run again:
   its first ``--calls`` calls are answered from the record. Ratio = those calls' seconds
   replayed / generated (target <= 0.05).
3. Park window: ``--sessions`` sessions making calls without end, then prepare (every session
   parked at a boundary or generating), the engines' cut of the calls generating, commit,
   resume; against the same with one session.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollsafe.testing.waiting import eventually_async

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You book meetings. Answer in one sentence."},
    {"role": "user", "content": "Book a meeting with Carlos on Friday at ten for thirty minutes."},
]
ENGINE_TOKEN, ENV_TOKEN = "bench-engine", "bench-env"


async def agent(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's agent (run by the gateway): ``calls`` chat completions, each timed."""
    import openai

    seconds = []
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as model:
        for _ in range(int(task["calls"])):
            start = time.perf_counter()
            await model.chat.completions.create(
                model="bench",
                messages=MESSAGES,
                max_tokens=int(task["max_tokens"]),
            )
            seconds.append(time.perf_counter() - start)
    return {"reward": 0.0, "seconds": seconds}


class Servers:
    """The engine and the gateway as processes, stopped by pid."""

    def __init__(self, root: Path, hold: str | None) -> None:
        from rollsafe.engine.loop import HOLD_ENV, HoldRule
        from rollsafe.engine.vllm.models import ModelSpec, make_model
        from rollsafe.gateway.serve import GATEWAY_BANNER
        from rollsafe.http.bearer import ENGINE_TOKEN_ENV, ENV_TOKEN_ENV
        from rollsafe.http.served import ENGINE_BANNER, ServedProcess, rollsafe_command

        self.model = make_model(root / "model", ModelSpec())
        env = {ENGINE_TOKEN_ENV: ENGINE_TOKEN, ENV_TOKEN_ENV: ENV_TOKEN}
        engine_env = dict(env)
        if hold is not None:
            engine_env[HOLD_ENV] = HoldRule(calls=hold, once=False).model_dump_json()
        self.started: list[Any] = []
        args = ["engine", "serve", "--model", str(self.model), "--port", "0"]
        self.engine = ServedProcess(rollsafe_command(*args), root / "engine", engine_env)
        self.started.append(self.engine)
        self.engine.wait_listening(ENGINE_BANNER.format(kind="dense"))
        args = ["gateway", "serve", "--model", str(self.model), "--engine-url", self.engine.url]
        args += ["--agent", "bench.gateway_bench:agent", "--port", "0", "--instance", "gw"]
        args += ["--snapshot-root", str(root)]
        self.gateway = ServedProcess(rollsafe_command(*args), root / "gateway", env)
        self.started.append(self.gateway)
        self.gateway.wait_listening(GATEWAY_BANNER.format(instance="gw"))

    def stop(self) -> None:
        for process in reversed(self.started):
            process.stop()


def episode(rollout: str, attempt: int = 0) -> Any:
    from rollsafe.env.protocol import EpisodeRef

    return EpisodeRef(rollout_id=f"{rollout}_g0", attempt=attempt)


async def run(env: Any, ref: Any, calls: int, max_tokens: int) -> list[float]:
    from rollsafe.env.protocol import RunEpisode

    task = {"calls": calls, "max_tokens": max_tokens}
    result = await env.run_episode(RunEpisode(episode=ref, task=task))
    return list(result.info["agent"]["seconds"])


async def engine_calls(servers: Servers, ref: Any, calls: int, max_tokens: int) -> list[float]:
    """The agent's calls made on the engine protocol: the same requests, hence the same tokens."""
    from rollsafe.engine.http import EngineClient
    from rollsafe.engine.text import ChatCodec
    from rollsafe.env.session import turn_request

    codec = ChatCodec.load(servers.model)
    prompt = codec.render(MESSAGES)
    seconds = []
    async with EngineClient(servers.engine.url, ENGINE_TOKEN) as engine:
        for turn in range(calls):
            request = turn_request(
                ref, turn, prompt, max_tokens=max_tokens, stop_token_ids=codec.stop_token_ids
            )
            start = time.perf_counter()
            async for _ in engine.generate(request):
                pass
            seconds.append(time.perf_counter() - start)
    return seconds


async def overhead(servers: Servers, env: Any, args: argparse.Namespace) -> dict[str, float]:
    gateway_s, engine_s = [], []
    for repeat in range(args.repeats):
        ref = episode(f"overhead-{repeat}")
        if repeat == 0:  # warm-up, untimed: the first call loads what the rest reuse
            await run(env, episode("warm-0"), 1, args.max_tokens)
        order = ("gateway", "engine") if repeat % 2 == 0 else ("engine", "gateway")
        for side in order:
            if side == "gateway":
                gateway_s.append(sum(await run(env, ref, args.calls, args.max_tokens)))
            else:
                engine_s.append(sum(await engine_calls(servers, ref, args.calls, args.max_tokens)))
    per_call = statistics.median(gateway_s) / args.calls, statistics.median(engine_s) / args.calls
    return {"gateway_ms": per_call[0] * 1e3, "engine_ms": per_call[1] * 1e3,
            "ratio": per_call[0] / per_call[1]}  # fmt: skip


async def replay(servers: Servers, env: Any, args: argparse.Namespace) -> dict[str, float]:
    """See the module docstring (2.): the hold rule holds the replay rollout's last call."""
    from rollsafe.engine.http import EngineClient
    from rollsafe.env import protocol as wire

    ref = episode("replay-0")
    running = asyncio.create_task(run(env, ref, args.calls + 1, args.max_tokens))
    async with EngineClient(servers.engine.url, ENGINE_TOKEN) as engine:
        await eventually_async(lambda: _held(engine), what="the replay's last call held")
        parked = await env.prepare(
            wire.PrepareRequest(checkpoint_id="ck-replay", deadline_ts=time.time() + 60)
        )
        [call] = [p.model_call_id for p in parked.parked]
        [prefix] = (await engine.cut([call])).prefixes
    dest = Path(args.dir) / "ck-replay"
    await env.commit(wire.CommitRequest(checkpoint_id="ck-replay", scope=(ref,), dest=str(dest)))
    await env.resume(wire.ResumeRequest(checkpoint_id="ck-replay"))
    await env.retire(wire.RetireRequest(rollouts=(ref,)))
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    restore = wire.RestoreRequest(
        restore_id="rs-replay", source_checkpoint_id="ck-replay", root=str(dest), scope=(ref,),
        prefixes={call: prefix.model_dump(mode="json")}, deadline_ts=time.time() + 60,
    )  # fmt: skip
    await env.restore(restore)
    await env.resume(wire.ResumeRequest(checkpoint_id="rs-replay"))
    replayed = await run(env, ref.next_attempt(), args.calls + 1, args.max_tokens)
    generated = await run(env, episode("replay-1"), args.calls, args.max_tokens)
    ratio = sum(replayed[: args.calls]) / sum(generated)
    return {"calls": args.calls, "replayed_ms": sum(replayed[: args.calls]) * 1e3,
            "generated_ms": sum(generated) * 1e3, "ratio": ratio}  # fmt: skip


async def _held(engine: Any) -> bool:
    return bool((await engine.info()).held >= 1)


async def _live(env: Any, sessions: int) -> bool:
    return bool((await env.status()).live_episodes >= sessions)


async def park_window(servers: Servers, env: Any, sessions: int, tag: str, root: Path) -> float:
    """prepare + cut + commit + resume with ``sessions`` sessions calling without end."""
    from rollsafe.engine.http import EngineClient
    from rollsafe.env import protocol as wire

    refs = [episode(f"{tag}-{i}") for i in range(sessions)]
    tasks = [asyncio.create_task(run(env, ref, 1_000_000, 16)) for ref in refs]
    await eventually_async(lambda: _live(env, sessions), what=f"{sessions} sessions running")
    cid = f"ck-{tag}"
    async with EngineClient(servers.engine.url, ENGINE_TOKEN) as engine:
        start = time.perf_counter()
        parked = await env.prepare(
            wire.PrepareRequest(checkpoint_id=cid, deadline_ts=time.time() + 60)
        )
        calls = [p.model_call_id for p in parked.parked if p.model_call_id]
        if calls:
            await engine.cut(calls)
        scope = tuple(p.episode for p in parked.parked)
        await env.commit(wire.CommitRequest(checkpoint_id=cid, scope=scope, dest=str(root / cid)))
        await env.resume(wire.ResumeRequest(checkpoint_id=cid))
        wall = time.perf_counter() - start
        if calls:
            await engine.release(calls)
    if len(parked.parked) != sessions:
        raise RuntimeError(f"{len(parked.parked)} of {sessions} sessions parked")
    await env.retire(wire.RetireRequest(rollouts=tuple(refs)))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return wall


async def main_async(args: argparse.Namespace) -> None:
    from rollsafe.env.client import EnvClient

    root = Path(args.dir)
    servers = Servers(root, hold=rf"replay-0_g0/t{args.calls}$")
    try:
        async with EnvClient(servers.gateway.url, ENV_TOKEN, timeout_s=120) as env:
            print("\n1. overhead per call: through the gateway vs the engine protocol (median)")
            row = await overhead(servers, env, args)
            print(f"   gateway {row['gateway_ms']:.1f} ms, engine {row['engine_ms']:.1f} ms, "
                  f"ratio {row['ratio']:.3f} (target <= 1.10)")  # fmt: skip
            print(f"\n2. a {args.calls}-call session replayed from its record vs generated")
            row = await replay(servers, env, args)
            print(f"   replayed {row['replayed_ms']:.0f} ms, generated {row['generated_ms']:.0f} "
                  f"ms, ratio {row['ratio']:.3f} (target <= 0.05)")  # fmt: skip
            print(f"\n3. park window (prepare + cut + commit + resume), {args.sessions} sessions")
            one = statistics.median(
                [await park_window(servers, env, 1, f"one{r}", root) for r in range(args.repeats)]
            )
            many = statistics.median(
                [
                    await park_window(servers, env, args.sessions, f"many{r}", root)
                    for r in range(args.repeats)
                ]
            )
            print(f"   1 session {one * 1e3:.0f} ms, {args.sessions} sessions {many * 1e3:.0f} ms, "
                  f"ratio {many / one:.2f}")  # fmt: skip
    finally:
        servers.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    args.dir = args.dir or tempfile.mkdtemp(prefix="gateway-bench-")
    print(f"python {platform.python_version()}; cpus={os.cpu_count()}; {platform.platform()}")
    print(f"calls={args.calls}; max_tokens={args.max_tokens}; repeats={args.repeats}")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
