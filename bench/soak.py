"""``make soak``: the demo again and again with randomized faults, seeds, samplers and restore
levels, each run checked by ``rollsafe verify``; the results table goes to ``docs/soak.md``.

Not part of CI (each run starts every part afresh and takes a minute or two). A run counts as
a violation when verify names one (exit 1) or the evidence is missing or malformed (exit 2); a
run that fails to finish (any other exit) is reported as such, with the end of its output.

    .venv/bin/python bench/soak.py --runs 8 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rollsafe.core.phases import PHASES
from rollsafe.http.served import rollsafe_command

LEVELS = ("prefix", "turn", "sibling", "prompt_group")
SAMPLERS = ("windowed", "in_order", "weight_fifo")


@dataclass(frozen=True)
class Plan:
    seed: int
    deterministic: bool
    sampler: str
    level: str
    faults: tuple[str, ...]

    def args(self, steps: int) -> list[str]:
        args = ["--steps", str(steps), "--seed", str(self.seed), "--restore-level", self.level]
        args += ["--deterministic"] if self.deterministic else ["--sampler", self.sampler]
        for fault in self.faults:
            args += ["--fault", fault]
        return args


@dataclass(frozen=True)
class Outcome:
    plan: Plan
    exit_code: int
    violations: int
    detail: str
    seconds: float
    snapshots: int
    prefix_tokens: int


KINDS = ("coordinator", "temporal", "run", "kill", "env-lost", "env")


def plan_run(rng: random.Random, seed: int, steps: int) -> Plan:
    """One to four faults, never two of a kind (the demo injects at most one of each), the
    crashes (run, kill, env-lost) at different steps, coordinator and temporal in different
    phases."""
    kinds = rng.sample(KINDS, k=rng.randint(1, 4))
    faults, phases = [], rng.sample(PHASES, k=2)
    crash_steps = rng.sample(range(1, steps + 1), k=min(3, steps))
    for kind in sorted(kinds):
        if kind in ("coordinator", "temporal"):
            faults.append(f"{kind}@{phases.pop().value}")
        elif kind in ("run", "kill", "env-lost"):
            if crash_steps:
                faults.append(f"{kind}@step{crash_steps.pop()}")
        else:
            faults.append("env@prepare")
    deterministic = rng.random() < 0.3
    return Plan(
        seed=seed,
        deterministic=deterministic,
        sampler="in_order" if deterministic else rng.choice(SAMPLERS),
        level=rng.choice(LEVELS),
        faults=tuple(faults),
    )


def run_one(plan: Plan, steps: int, out: Path, timeout_s: float) -> Outcome:
    began = time.monotonic()
    command = [*rollsafe_command("demo", "--out", str(out)), *plan.args(steps)]
    demo = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = demo.communicate(timeout=timeout_s)
        code, tail = demo.returncode, output[-400:]
    except subprocess.TimeoutExpired:
        demo.terminate()  # SIGTERM: the demo stops every process it started, by pid
        try:
            demo.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            demo.kill()  # its own children may outlive it: named in the table, to clean up
            demo.communicate()
        code, tail = -1, f"timed out after {timeout_s:g}s"
    seconds = time.monotonic() - began
    if code not in (0, 1):  # it did not finish: its evidence is incomplete, not violated
        return Outcome(plan, code, 0, f"demo exited {code}: {tail.strip()}", seconds, 0, 0)
    verdict = subprocess.run(
        rollsafe_command("verify", str(out), "--json"), capture_output=True, text=True
    )
    if verdict.returncode in (0, 1):
        checks = json.loads(verdict.stdout)["checks"]
        failed = [c for c in checks if not c["ok"]]
        violations, detail = len(failed), "; ".join(f"{c['name']}: {c['detail']}" for c in failed)
    else:
        violations, detail = 1, f"evidence unreadable: {verdict.stderr.strip()[-300:]}"
    report = out / "report.json"
    totals = json.loads(report.read_text())["totals"] if report.exists() else {}
    prefix = 0
    if (out / "trained_rows.jsonl").exists():
        with open(out / "trained_rows.jsonl") as rows:
            prefix = sum(json.loads(line)["restored_prefix_tokens"] for line in rows)
    return Outcome(
        plan=plan,
        exit_code=code,
        violations=violations,
        detail=detail,
        seconds=seconds,
        snapshots=int(totals.get("snapshots_published", 0)),
        prefix_tokens=prefix,
    )


def table(outcomes: list[Outcome], steps: int, command: str) -> str:
    faults = sum(len(o.plan.faults) for o in outcomes)
    violations = sum(o.violations for o in outcomes)
    unfinished = sum(o.exit_code not in (0, 1) for o in outcomes)
    lines = [
        "# Soak: the demo under randomized faults",
        "",
        f"`{command}` on {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, {steps} steps a run."
        " Each run draws a seed, a mode (deterministic in 3 of 10, else a random sampler), a"
        " restore level, and one to four faults of six kinds (docs/demo.md: a random phase for"
        " the coordinator and the Temporal server, a random step for each crash: the whole run"
        " killed after a snapshot mid-generation or between two, or an environment instance"
        " lost for good); `rollsafe verify` checks its evidence.",
        "",
        f"**{len(outcomes)} runs, {faults} faults injected, {violations} violations, "
        f"{unfinished} runs that did not finish.**",
        "",
        "| run | seed | mode | level | faults | exit | violations | snapshots | prefix tokens "
        "| seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, o in enumerate(outcomes):
        mode = "deterministic" if o.plan.deterministic else o.plan.sampler
        lines.append(
            f"| {n} | {o.plan.seed} | {mode} | {o.plan.level} | {', '.join(o.plan.faults)} "
            f"| {o.exit_code} | {o.violations} | {o.snapshots} | {o.prefix_tokens} "
            f"| {o.seconds:.0f} |"
        )
    problems = [(n, o) for n, o in enumerate(outcomes) if o.detail]
    if problems:
        lines += ["", "## What went wrong", ""]
        lines += [f"- run {n}: {o.detail}" for n, o in problems]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="draws the runs' plans")
    parser.add_argument("--doc", type=Path, default=Path("docs/soak.md"))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run")
    parser.add_argument("--keep", action="store_true", help="keep every run's directory")
    options = parser.parse_args()
    if options.steps < 2:
        parser.error("--steps must be at least 2 (the environment fault hits step 2)")
    rng = random.Random(options.seed)
    work = Path(tempfile.mkdtemp(prefix="rollsafe-soak-"))
    outcomes = []
    try:
        for n in range(options.runs):
            plan = plan_run(rng, seed=rng.randrange(1000), steps=options.steps)
            outcome = run_one(plan, options.steps, work / f"run-{n}", options.timeout)
            outcomes.append(outcome)
            print(
                f"run {n}: {' '.join(plan.args(options.steps))} -> exit {outcome.exit_code}, "
                f"{outcome.violations} violations, {outcome.seconds:.0f}s",
                flush=True,
            )
    finally:
        if not options.keep:
            shutil.rmtree(work, ignore_errors=True)
    command = " ".join(["python bench/soak.py", *sys.argv[1:]])
    options.doc.write_text(table(outcomes, options.steps, command))
    print(f"wrote {options.doc}")
    failed = any(o.violations or o.exit_code not in (0, 1) for o in outcomes)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
