"""The trainers users already run, under rollsafe, as a user meets them, on one vLLM engine
behind ``rollsafe engine serve`` (a tiny model built here) and two ``completion`` environment
instances, against a Temporal server; each SIGKILLed mid-run and started again with the same
command, then verified from the run's evidence alone (``rollsafe verify``'s checks: every group
trained once, whole; no sealed rollout generated twice):

- examples/grpo_loop.py (docs/integrating.md), configured by environment variables only, killed
  while the next step's rollouts generate; its checkpoints (one per step) show it trained;
- TRL's GRPOTrainer, real and unmodified, with rollsafe's rollouts
  (rollsafe.integrations.trl.LosslessRollouts) and without, killed at the same point between two
  of TRL's checkpoints and resumed as TRL's docs say (``trainer.train(resume_from_checkpoint=
  True)``). With rollsafe, the calls the snapshot at checkpoint-2 cut stay held on the engine
  until the kill, so the trainer is killed waiting for them in step 3; the resumed trainer
  restores the run at checkpoint-2, resumes those calls from their prefixes, and trains step 2's
  groups again from their sealed rows (not generated again). TRL alone, run side by side with it
  (sending no weights: one engine serves one trainer's), generates step 2's prompts again."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from rollsafe.engine.http import EngineClient
from rollsafe.engine.loop import HoldRule
from rollsafe.evidence.files import (
    GENERATIONS,
    Evidence,
    GenerationEvent,
    append_lines,
    read_lines,
)
from rollsafe.evidence.verify import account_generations, verify
from rollsafe.loop_thread import LoopThread
from rollsafe.reference.rl.controller import Endpoints
from rollsafe.reference.rl.policy import HfModel
from rollsafe.reference.rl.servers import RunServers
from rollsafe.testing.trl_run import GROUP_SIZE, GROUPS_PER_STEP, PLAIN_GENERATIONS, user_env
from rollsafe.testing.waiting import eventually

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_loop.py"
EXAMPLE_STEPS = 4
EXAMPLE_KILL_AFTER = "[step 1]"  # step 2's rollouts generate meanwhile: no snapshot holds them

RUN_ID = f"trl-{uuid.uuid4().hex[:8]}"  # the engine's hold rule names it
STEPS, SAVE_STEPS = 6, 2
HELD_GROUPS = (6, 7)  # step 3's: generating when checkpoint-2's snapshot cuts them
KILL_AFTER = "[step 3]"  # then the trainer waits for step 3's held groups


class Servers:
    """The module's engine and environments, and where they listen now."""

    def __init__(self, servers: RunServers, endpoints: Endpoints, model: Path) -> None:
        self.servers, self.endpoints, self.model = servers, endpoints, model

    def restart_environments(self) -> Endpoints:
        self.endpoints = self.servers.restart_environments()
        return self.endpoints


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    from rollsafe.engine.vllm.models import ModelSpec, make_model

    model = make_model(tmp_path_factory.mktemp("trl-model") / "model", ModelSpec(seed=0))
    groups = "|".join(str(idx) for idx in HELD_GROUPS)
    hold = HoldRule(calls=rf"^{RUN_ID}-({groups})_g\d+/", after_tokens=2, once=False, keep_cut=True)
    servers = RunServers(
        tmp_path_factory.mktemp("trl-servers"),
        ["env-0", "env-1"],
        seed=0,
        engine_token=uuid.uuid4().hex,
        env_token=uuid.uuid4().hex,
        model=HfModel(path=model),
        environment="completion",
    )
    try:
        yield Servers(servers, servers.start(hold=hold), model)
    finally:
        servers.stop()


def example_command(model: Path, tmp_path: Path) -> list[str]:
    return [
        *(sys.executable, str(EXAMPLE), "--model", str(model), "--steps", str(EXAMPLE_STEPS)),
        *("--trainer-dir", str(tmp_path / "trainer"), "--evidence", str(tmp_path / "evidence")),
    ]


def trl_command(mode: str, model: Path, out: Path, *, resume: bool = False) -> list[str]:
    return [
        *(sys.executable, "-m", "rollsafe.testing.trl_run", "--mode", mode),
        *("--model", str(model), "--out", str(out)),
        *("--max-steps", str(STEPS), "--save-steps", str(SAVE_STEPS)),
        *(["--resume"] if resume else []),
        *(["--keep-engine-weights"] if mode == "plain" else []),  # the engine has one trainer
    ]


def run_until(command: list[str], env: dict[str, str], line_start: str, err: Path) -> list[str]:
    """Start ``command``, SIGKILL it as soon as it prints a line starting with ``line_start``
    (an event, no timing); the lines it printed."""
    with err.open("wb") as stderr:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, env=env, text=True
        )
        try:
            seen: list[str] = []
            assert process.stdout is not None
            for line in process.stdout:
                seen.append(line)
                if line.startswith(line_start):
                    process.kill()
                    break
            assert seen and seen[-1].startswith(line_start), (seen, err.read_text()[-3000:])
            return seen
        finally:
            process.kill()
            process.wait()


def run_to_end(command: list[str], env: dict[str, str]) -> list[str]:
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [line for line in done.stdout.splitlines() if line.startswith("[")]


def engine_idle(endpoints: Endpoints) -> None:
    """Until the engine holds no call: the killed environments' streams are gone."""
    loop = LoopThread("trl-test")

    async def calls() -> int:
        async with EngineClient(endpoints.engine_url, endpoints.engine_token) as engine:
            info = await engine.info()
            return info.active + info.frozen + info.held

    try:
        eventually(lambda: loop.run(calls()) == 0, timeout_s=60, what="the engine let go")
    finally:
        loop.close()


@pytest.mark.timeout(900)
def test_the_example_killed_mid_run_restores_and_trains_every_group_once(
    server: Any, servers: Servers, tmp_path: Path
) -> None:
    run_id, command = f"example-{uuid.uuid4().hex[:8]}", example_command(servers.model, tmp_path)
    env = user_env(server.settings(), servers.endpoints, tmp_path, run_id)
    env.update(ROLLSAFE_RUN__GROUP_SIZE="2", ROLLSAFE_RUN__GROUPS_PER_STEP="2")
    env.update(ROLLSAFE_RUN__SAMPLER="in_order")
    run_until(command, env, EXAMPLE_KILL_AFTER, tmp_path / "first.err")
    killed = GenerationEvent(event="killed", at_unix=time.time())
    append_lines(tmp_path / "evidence" / GENERATIONS, [killed])
    lines = run_to_end(command, env)
    assert lines[0] == "[restore] weight version 2", lines  # the checkpoint step 1 saved
    assert [line.split("]")[0] for line in lines[1:]] == ["[step 2", "[step 3", "[done"], lines

    evidence = Evidence.read(tmp_path / "evidence")
    checks = {check.name: check for check in verify(evidence)}
    assert all(check.ok for check in checks.values()), checks
    assert "no sealed rollout generated twice" in checks  # the journal kept every seal
    trained = Counter(row.group_idx for row in evidence.trained)
    assert trained == {idx: 2 for idx in range(EXAMPLE_STEPS * 2)}  # once each, whole
    assert all(row.n_tokens > 0 for row in evidence.trained)
    checkpoints = tmp_path / "trainer"
    assert sorted(p.name for p in checkpoints.glob("v*.safetensors")) == [
        f"v{v}.safetensors" for v in range(EXAMPLE_STEPS + 1)
    ]
    first, last = (load_file(checkpoints / f"v{v}.safetensors") for v in (0, EXAMPLE_STEPS))
    assert any(not first[k].equal(last[k]) for k in first)  # its optimizer changed the weights


@pytest.mark.timeout(900)
def test_trl_with_and_without_rollsafe_killed_at_the_same_point(
    server: Any, servers: Servers, tmp_path: Path
) -> None:
    """Side by side on the one engine: each mode's first life runs until step 3 committed and
    is SIGKILLed (rollsafe's then waits on its held groups); then each is resumed from TRL's
    newest checkpoint, checkpoint-2, and runs to the end."""
    env = user_env(server.settings(), servers.endpoints, tmp_path, RUN_ID)
    outs = {mode: tmp_path / mode for mode in ("rollsafe", "plain")}
    for out in outs.values():
        out.mkdir()
    with ThreadPoolExecutor(2) as pool:
        firsts = {
            mode: pool.submit(
                run_until, trl_command(mode, servers.model, out), env, KILL_AFTER, out / "err"
            )
            for mode, out in outs.items()
        }
        first = {mode: future.result() for mode, future in firsts.items()}
    assert "[saved 2]\n" in first["rollsafe"] and "[saved 4]\n" not in first["rollsafe"]
    for generations in (
        outs["rollsafe"] / "evidence" / GENERATIONS,
        outs["plain"] / PLAIN_GENERATIONS,
    ):
        append_lines(generations, [GenerationEvent(event="killed", at_unix=time.time())])
    # The trainer's node died with its environments; the engine lives on and lets go of their
    # calls. The user starts the same command again, resuming from TRL's newest checkpoint.
    endpoints = servers.restart_environments()
    engine_idle(endpoints)
    env = user_env(server.settings(), endpoints, tmp_path, RUN_ID)
    with ThreadPoolExecutor(2) as pool:
        seconds = {
            mode: pool.submit(run_to_end, trl_command(mode, servers.model, out, resume=True), env)
            for mode, out in outs.items()
        }
        second = {mode: future.result() for mode, future in seconds.items()}
    for mode, lines in second.items():
        steps = [line.split("]")[0] for line in lines if line.startswith("[step")]
        assert steps == [f"[step {n}" for n in range(3, STEPS + 1)], (mode, lines)
    check_rollsafe_lost_nothing(outs["rollsafe"])
    # TRL alone: step 2's prompts were finished and trained, and are generated again.
    spent = account_generations(read_lines(outs["plain"] / PLAIN_GENERATIONS, GenerationEvent))
    again = sorted({int(rollout.split("-")[1].split("_")[0]) for rollout in spent.sealed_twice})
    assert again[:2] == [4, 5], again


def check_rollsafe_lost_nothing(out: Path) -> None:
    evidence = Evidence.read(out / "evidence")
    checks = {check.name: check for check in verify(evidence)}
    assert all(check.ok for check in checks.values()), checks
    assert "no sealed rollout generated twice" in checks
    trained = Counter(row.group_idx for row in evidence.trained)
    assert trained == {idx: GROUP_SIZE for idx in range(STEPS * GROUPS_PER_STEP)}  # once each
    rolled_back = {row.group_idx for row in evidence.rolled_back}
    assert rolled_back == {4, 5}  # step 2 committed after checkpoint-2: trained again
    resumed = {row.group_idx for row in evidence.trained if row.restored_prefix_tokens >= 2}
    assert resumed == set(HELD_GROUPS)  # their cut calls resumed from the prefix, not redone
    saved = sorted(p.name for p in (out / "trl").glob("checkpoint-*"))
    assert saved == [f"checkpoint-{n}" for n in range(SAVE_STEPS, STEPS + 1, SAVE_STEPS)]
