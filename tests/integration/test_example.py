"""examples/grpo_loop.py as a user meets it (docs/integrating.md): configured by environment
variables only, against a Temporal server, vLLM behind ``rollsafe engine serve`` and two
workplace environment instances; SIGKILLed mid-run (episodes of the next step in flight),
started again with the same command, restored, run to the end. Verified from the trainer's own
checkpoints: every group handed out is trained exactly once, every row has its tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollsafe.reference.rl.controller import Endpoints
from rollsafe.reference.rl.policy import HfModel
from rollsafe.reference.rl.servers import RunServers

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_loop.py"
STEPS, GROUP_SIZE, GROUPS_PER_STEP = 4, 2, 2
# Killed at the first episode dispatched after the snapshot at weight version 2: the
# environments and vLLM are running it, no snapshot has it.
KILL_AFTER = "[step 1]"
KILL_AT = "[episode]"


@pytest.fixture(scope="module")
def endpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoints]:
    from rollsafe.engine.vllm.models import ModelSpec, make_model

    root = tmp_path_factory.mktemp("example-servers")
    model = make_model(root / "model", ModelSpec(arch="dense", seed=0))
    servers = RunServers(
        root / "logs",
        ["env-0", "env-1"],
        seed=0,
        engine_token=uuid.uuid4().hex,
        env_token=uuid.uuid4().hex,
        max_tokens=8,
        model=HfModel(path=model),
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
        "ROLLSAFE_RUN__RESTORE_LEVEL": "prefix",
        "ROLLSAFE_PARTICIPANTS__ENVS": json.dumps(endpoints.envs),
        "ROLLSAFE_PARTICIPANTS__ENGINES": json.dumps({"vllm": endpoints.engine_url}),
        "ROLLSAFE_ENV_TOKEN": endpoints.env_token,
        "ROLLSAFE_ENGINE_TOKEN": endpoints.engine_token,
        "TEMPORAL_ADDRESS": connection.address,
        "TEMPORAL_NAMESPACE": connection.namespace,
    }


def command(trainer_dir: Path) -> list[str]:
    return [
        sys.executable,
        str(EXAMPLE),
        "-v",
        "--steps",
        str(STEPS),
        "--trainer-dir",
        str(trainer_dir),
    ]


@pytest.mark.timeout(900)
def test_the_example_killed_mid_run_restores_and_trains_every_group_once(
    server: Any, endpoints: Endpoints, tmp_path: Path
) -> None:
    env, trainer_dir = example_env(server, endpoints, tmp_path), tmp_path / "trainer"
    with (tmp_path / "first.err").open("wb") as err:
        first = subprocess.Popen(
            command(trainer_dir), stdout=subprocess.PIPE, stderr=err, env=env, text=True
        )
        try:
            seen: list[str] = []
            assert first.stdout is not None
            for line in first.stdout:  # events: the lines the example prints, no timing
                seen.append(line)
                stepped = any(s.startswith(KILL_AFTER) for s in seen)
                if stepped and line.startswith(KILL_AT):
                    first.kill()
                    break
            assert seen and seen[-1].startswith(KILL_AT), seen
        finally:
            first.kill()
            first.wait()
    second = subprocess.run(
        command(trainer_dir), capture_output=True, text=True, env=env, timeout=600
    )
    assert second.returncode == 0, second.stderr[-4000:]
    lines = second.stdout.splitlines()
    [restored] = [line for line in lines if line.startswith("[restore]")]
    assert "weight version 2" in restored or "weight version 3" in restored, restored
    assert lines[-1] == f"[done] {STEPS} steps, {STEPS * GROUPS_PER_STEP} groups trained"

    history = json.loads((trainer_dir / f"v{STEPS}.json").read_text())
    trained = sorted(entry["group"] for entry in history)
    assert trained == list(range(STEPS * GROUPS_PER_STEP))  # each once: none lost, none twice
    assert [entry["step"] for entry in history] == [s for s in range(STEPS) for _ in "ab"]
    assert all(len(e["tokens"]) == GROUP_SIZE and min(e["tokens"]) > 0 for e in history)
    assert sorted(int(p.stem[1:]) for p in trainer_dir.glob("v*.json")) == list(range(STEPS + 1))
