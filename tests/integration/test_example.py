"""examples/grpo_loop.py as a user meets it (docs/integrating.md): configured by environment
variables only, against a Temporal server, vLLM behind ``rollsafe engine serve`` and two
``completion`` environment instances; SIGKILLed mid-run (the next step's rollouts generating),
started again with the same command, restored, run to the end. Verified from the run's evidence
alone (``rollsafe verify``'s checks: every group trained once, whole; no sealed rollout generated
twice) and from the trainer's checkpoints (one per step, the weights changed by training)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from rollsafe.evidence.files import GENERATIONS, Evidence, GenerationEvent, append_lines
from rollsafe.evidence.verify import verify
from rollsafe.reference.rl.controller import Endpoints
from rollsafe.reference.rl.policy import HfModel
from rollsafe.reference.rl.servers import RunServers

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_loop.py"
STEPS, GROUP_SIZE, GROUPS_PER_STEP = 4, 2, 2
KILL_AFTER = "[step 1]"  # step 2's rollouts generate meanwhile: no snapshot holds them whole


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollsafe.engine.vllm.models import ModelSpec, make_model

    return make_model(tmp_path_factory.mktemp("example-model") / "model", ModelSpec(seed=0))


@pytest.fixture(scope="module")
def endpoints(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[Endpoints]:
    servers = RunServers(
        tmp_path_factory.mktemp("example-servers"),
        ["env-0", "env-1"],
        seed=0,
        engine_token=uuid.uuid4().hex,
        env_token=uuid.uuid4().hex,
        model=HfModel(path=model),
        environment="completion",
    )
    try:
        yield servers.start()
    finally:
        servers.stop()


def example_env(server: Any, endpoints: Endpoints, tmp_path: Path) -> dict[str, str]:
    """What the user exports: rollsafe's settings, Temporal's, the servers' tokens."""
    connection = server.settings()
    return {
        **os.environ,
        "ROLLSAFE_RUN_ID": f"example-{uuid.uuid4().hex[:8]}",
        "ROLLSAFE_SNAPSHOT_ROOT": str(tmp_path / "snapshots"),
        "ROLLSAFE_RUN__GROUP_SIZE": str(GROUP_SIZE),
        "ROLLSAFE_RUN__GROUPS_PER_STEP": str(GROUPS_PER_STEP),
        "ROLLSAFE_RUN__SAMPLER": "in_order",
        "ROLLSAFE_PARTICIPANTS__ENVS": json.dumps(endpoints.envs),
        "ROLLSAFE_PARTICIPANTS__ENGINES": json.dumps({"vllm": endpoints.engine_url}),
        "ROLLSAFE_ENV_TOKEN": endpoints.env_token,
        "ROLLSAFE_ENGINE_TOKEN": endpoints.engine_token,
        "TEMPORAL_ADDRESS": connection.address,
        "TEMPORAL_NAMESPACE": connection.namespace,
    }


def command(model: Path, tmp_path: Path) -> list[str]:
    return [
        sys.executable,
        str(EXAMPLE),
        *("--model", str(model), "--steps", str(STEPS)),
        *("--trainer-dir", str(tmp_path / "trainer"), "--evidence", str(tmp_path / "evidence")),
    ]


@pytest.mark.timeout(900)
def test_the_example_killed_mid_run_restores_and_trains_every_group_once(
    server: Any, endpoints: Endpoints, model: Path, tmp_path: Path
) -> None:
    env = example_env(server, endpoints, tmp_path)
    with (tmp_path / "first.err").open("wb") as err:
        first = subprocess.Popen(
            command(model, tmp_path), stdout=subprocess.PIPE, stderr=err, env=env, text=True
        )
        try:
            seen: list[str] = []
            assert first.stdout is not None
            for line in first.stdout:  # events: the lines the example prints, no timing
                seen.append(line)
                if line.startswith(KILL_AFTER):
                    first.kill()
                    break
            assert seen and seen[-1].startswith(KILL_AFTER), seen
        finally:
            first.kill()
            first.wait()
    killed = GenerationEvent(event="killed", at_unix=time.time())
    append_lines(tmp_path / "evidence" / GENERATIONS, [killed])
    second = subprocess.run(
        command(model, tmp_path), capture_output=True, text=True, env=env, timeout=600
    )
    assert second.returncode == 0, second.stderr[-4000:]
    lines = second.stdout.splitlines()
    assert lines[0] == "[restore] weight version 2", lines  # the checkpoint step 1 saved
    assert [line.split("]")[0] for line in lines[1:]] == ["[step 2", "[step 3", "[done"], lines

    evidence = Evidence.read(tmp_path / "evidence")
    checks = {check.name: check for check in verify(evidence)}
    assert all(check.ok for check in checks.values()), checks
    assert "no sealed rollout generated twice" in checks  # the journal kept every seal
    trained = sorted(row.group_idx for row in evidence.trained)
    assert trained == sorted(list(range(STEPS * GROUPS_PER_STEP)) * GROUP_SIZE)
    assert all(row.n_tokens > 0 for row in evidence.trained)
    checkpoints = tmp_path / "trainer"
    assert sorted(p.name for p in checkpoints.glob("v*.safetensors")) == [
        f"v{v}.safetensors" for v in range(STEPS + 1)
    ]
    first_weights, last_weights = (load_file(checkpoints / f"v{v}.safetensors") for v in (0, STEPS))
    assert any(not first_weights[k].equal(last_weights[k]) for k in first_weights)  # it trained
