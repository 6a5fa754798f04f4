"""TRL's GRPOTrainer with rollsafe's rollouts against TRL alone: what a SIGKILL between two
checkpoints costs, and what rollsafe costs while nothing fails.

    .venv/bin/python bench/trainer_resume_bench.py [--steps 24] [--save-steps 8] [--kill-after 12]

Real processes, as tests/integration/test_trainers.py starts them: a Temporal dev server, vLLM
behind ``rollsafe engine serve`` (a tiny model built here), two ``completion`` environment
instances, and the trainer (``python -m rollsafe.testing.trl_run``): the same prompts, reward,
seeds and engine in both modes. TRL alone is GRPOTrainer with a stateless ``rollout_func`` that
calls the engine and a callback that sends it each step's weights: how a TRL user wires an
external engine today.

1. Kill: each mode is SIGKILLed when step ``--kill-after`` has committed (checkpoints every
   ``--save-steps``), then resumed from TRL's newest checkpoint (``resume_from_checkpoint=True``)
   and run to ``--steps``. Reported per mode: completions generated again after finishing, their
   generation-seconds, the in-flight generation-seconds the kill lost (rollsafe's evidence only:
   TRL alone logs a completion when it returns), steps trained again (those after the
   checkpoint: the weights they made died with the process, in both modes), prompts skipped,
   and the seconds from the restart to its first committed step.
2. Throughput: an uninterrupted run of ``--steps`` in each mode, steps per second from the first
   committed step to the last (start-up apart: rollsafe's restore and first snapshot are in the
   kill's figures); ratio = with rollsafe / alone (target >= 0.95). Also the median step whose
   interval holds no checkpoint: the ratio without the anchored snapshot waited for at each.

Both modes generate synchronously by default (``--ahead-steps 0``): on a 2-core machine the
engine and the trainer share the cores, so generation overlapping training (rollsafe's
``ahead_steps``, its point on GPUs) only makes them contend, and the ratio would measure that.
Generation-seconds are summed per completion, from its request to its answer (concurrent
completions each count), the same way in both modes (``account_generations``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from rollsafe.engine.vllm.models import ModelSpec, make_model
from rollsafe.evidence.files import (
    GENERATIONS,
    Evidence,
    GenerationEvent,
    append_lines,
    read_lines,
)
from rollsafe.evidence.verify import account_generations, verify
from rollsafe.reference.rl.policy import HfModel
from rollsafe.reference.rl.servers import RunServers
from rollsafe.temporal.devserver import DevServer
from rollsafe.testing.trl_run import PLAIN_GENERATIONS, user_env


def new_run_id() -> str:
    return f"bench-{uuid.uuid4().hex[:8]}"


def command(mode: str, model: Path, out: Path, args: argparse.Namespace, resume: bool) -> list[str]:
    return [
        *(sys.executable, "-m", "rollsafe.testing.trl_run", "--mode", mode, "--model", str(model)),
        *("--out", str(out), "--max-steps", str(args.steps), "--save-steps", str(args.save_steps)),
        *("--num-generations", str(args.group_size), "--groups-per-step", str(args.per_step)),
        *("--max-tokens", str(args.max_tokens), "--ahead-steps", str(args.ahead_steps)),
        *(["--resume"] if resume else []),
    ]


def run(cmd: list[str], env: dict[str, str], kill_at: str | None = None) -> list[tuple[float, str]]:
    """The lines ``cmd`` prints with the second each arrived (since its start); SIGKILLed at
    the first line starting with ``kill_at``."""
    started = time.monotonic()
    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True
    )
    lines: list[tuple[float, str]] = []
    assert process.stdout is not None
    for line in process.stdout:
        lines.append((time.monotonic() - started, line.strip()))
        if kill_at is not None and line.startswith(kill_at):
            process.kill()
            break
    process.wait()
    if kill_at is None and process.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with {process.returncode}")
    return lines


def step_times(lines: list[tuple[float, str]]) -> list[float]:
    """The wall clock each committed step printed (trl_run's ``[step N] <unix seconds>``)."""
    return [float(text.split()[2]) for _, text in lines if text.startswith("[step ")]


def first_step_s(lines: list[tuple[float, str]]) -> float:
    return next(at for at, text in lines if text.startswith("[step "))


def kill_and_resume(
    mode: str, env: dict[str, str], model: Path, root: Path, args: argparse.Namespace
) -> dict[str, float]:
    out = root / f"kill-{mode}"
    run(command(mode, model, out, args, False), env, kill_at=f"[step {args.kill_after}]")
    generations = out / "evidence" / GENERATIONS if mode == "rollsafe" else out / PLAIN_GENERATIONS
    append_lines(generations, [GenerationEvent(event="killed", at_unix=time.time())])
    resumed = run(command(mode, model, out, args, True), env)
    checkpoint = args.kill_after - args.kill_after % args.save_steps
    figures = {
        "first step after restart (s)": first_step_s(resumed),
        "steps trained again": float(args.kill_after - checkpoint),
        "prompts skipped": 0.0,
    }
    spent = account_generations(read_lines(generations, GenerationEvent))
    figures["completions generated again"] = float(len(spent.sealed_twice))
    figures["generation-seconds redone"] = spent.lost_s
    figures["in-flight generation-seconds lost"] = spent.redone_s
    if mode == "rollsafe":
        evidence = Evidence.read(out / "evidence")
        trained = {row.group_idx for row in evidence.trained}
        figures["prompts skipped"] = float(len(set(range(max(trained) + 1)) - trained))
        figures["evidence checks failed"] = float(sum(not c.ok for c in verify(evidence)))
    return figures


def throughput(
    mode: str, env: dict[str, str], model: Path, root: Path, args: argparse.Namespace
) -> tuple[float, float]:
    """Steps per second from the first committed step to the last, and the median seconds of
    a step whose interval holds no checkpoint (a save, and with rollsafe its snapshot)."""
    times = step_times(run(command(mode, model, root / f"steady-{mode}", args, False), env))
    steps = enumerate(itertools.pairwise(times), start=1)  # step n's interval: n to n + 1
    plain = [b - a for n, (a, b) in steps if n % args.save_steps]
    return (len(times) - 1) / (times[-1] - times[0]), statistics.median(plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-steps", type=int, default=8)
    parser.add_argument("--kill-after", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--per-step", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ahead-steps", type=int, default=0, help="rollsafe's (module doc)")
    args = parser.parse_args()
    print(f"# trainer resume bench: {platform.machine()}, {os.cpu_count()} cores, vLLM CPU")
    print(
        f"# {args.steps} steps, {args.per_step} prompts x {args.group_size} completions x "
        f"{args.max_tokens} tokens a step; checkpoints every {args.save_steps}; "
        f"SIGKILL after step {args.kill_after}"
    )
    with tempfile.TemporaryDirectory(prefix="trainer-bench-") as tmp:
        root = Path(tmp)
        model = make_model(root / "model", ModelSpec(seed=0))
        dev = DevServer(root / "temporal")
        asyncio.run(dev.start())
        servers = RunServers(
            root / "logs",
            ["env-0", "env-1"],
            seed=0,
            engine_token=uuid.uuid4().hex,
            env_token=uuid.uuid4().hex,
            model=HfModel(path=model),
            environment="completion",
        )
        try:
            endpoints = servers.start()
            modes = ("plain", "rollsafe")
            env = {mode: user_env(dev.settings(), endpoints, root, new_run_id()) for mode in modes}
            rates = {mode: throughput(mode, env[mode], model, root, args) for mode in modes}
            env = {mode: user_env(dev.settings(), endpoints, root, new_run_id()) for mode in modes}
            kills = {mode: kill_and_resume(mode, env[mode], model, root, args) for mode in modes}
        finally:
            servers.stop()
            dev.stop()
    print("\n| after a SIGKILL between checkpoints | TRL alone | TRL + rollsafe |")
    print("|---|---|---|")
    for name in kills["rollsafe"]:
        alone = kills["plain"].get(name)
        shown = "n/a" if alone is None else f"{alone:.2f}"
        print(f"| {name} | {shown} | {kills['rollsafe'][name]:.2f} |")
    (alone, alone_step), (rollsafe, rollsafe_step) = rates["plain"], rates["rollsafe"]
    print(
        f"\nthroughput: TRL alone {alone:.3f} steps/s, with rollsafe {rollsafe:.3f} steps/s; "
        f"ratio {rollsafe / alone:.3f} (target >= 0.95)\nmedian step between checkpoints: "
        f"TRL alone {alone_step:.3f} s, with rollsafe {rollsafe_step:.3f} s; "
        f"ratio {alone_step / rollsafe_step:.3f}"
    )


if __name__ == "__main__":
    main()
