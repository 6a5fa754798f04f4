"""``rollsafe demo --gym workplace_assistant`` as a user runs it: NeMo Gym 0.7.0's own simple_agent
and workplace_assistant, unmodified, with its legacy_agent environment server in front of the
agent (as NeMo RL runs it), as the run's environments behind rollsafe's gateways, in a whole run
(Temporal, Ray, the controller actor, a checkpoint worker, the trainer) with its default faults
but the checkpoint worker's (``test_demo.py`` has it; here it would cost a snapshot's 10 s):
every process killed mid-episode after each episode's calendar mutation (its next model call cut
by a snapshot), and every process killed between two snapshots.

What must hold: every step trained once (``rollsafe verify``), each trained episode's event in
the calendar its agent searched exactly once (the resources server's state, killed and
re-seeded: ``env_mutations.jsonl``), ``/verify`` scoring each trained episode right, and the
episodes the kill caught resumed from their cut calls' prefixes."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from rollsafe.evidence.files import Evidence
from rollsafe.evidence.verify import verify
from rollsafe.http.served import rollsafe_command
from rollsafe.reference.rl.gym_workplace import HELD_AFTER_TOKENS

STEPS = 3
pytestmark = pytest.mark.timeout(700)


def test_nemo_gym_agents_survive_the_demo_faults_with_every_effect_once(tmp_path: Path) -> None:
    out = tmp_path / "gym"
    flags = ["--gym", "workplace_assistant", "--steps", str(STEPS), "--out", str(out)]
    faults = ["--fault", "run@step2", "--fault", "kill@step3"]
    run = subprocess.run(
        rollsafe_command("demo", *flags, *faults), capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [start] = [line for line in run.stdout.splitlines() if line.startswith("[start]")]
    assert "NeMo Gym 0.7.0 workplace_assistant + legacy_agent + simple_agent" in start, start
    kinds = [json.loads(line)["kind"] for line in (out / "faults.jsonl").open()]
    assert sorted(kinds) == ["kill", "run"]

    evidence = Evidence.read(out)
    assert all(check.ok for check in verify(evidence)), verify(evidence)
    assert len(evidence.trained) == STEPS * 2 * 4  # steps x groups x rollouts
    # Each trained episode's event is in its session's calendar once: not lost with the killed
    # resources server, not made again by the replay or by the attempt the kill abandoned.
    events = Counter(m.rollout_id for m in evidence.mutations)
    assert events == Counter(row.rollout_id for row in evidence.trained)
    # /verify scored every step's episodes right: the agent's calls hold the creation once.
    steps = [line for line in run.stdout.splitlines() if line.startswith("[step ")]
    assert len(steps) == STEPS and all("reward 1.00" in line for line in steps), steps
    # The episodes the run@step2 kill caught came back as attempt 1 and resumed their cut
    # calls from the staged prefixes.
    resumed = [row for row in evidence.trained if row.restored_prefix_tokens]
    assert resumed, "no trained row resumed a cut call"
    assert all(row.attempt >= 1 for row in resumed)
    assert {row.restored_prefix_tokens % HELD_AFTER_TOKENS for row in resumed} == {0}
