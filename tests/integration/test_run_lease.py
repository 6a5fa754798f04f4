"""A trainer SIGKILLed mid-episode stops its episodes' effects within its run lease.

The trainer is rollsafe's own dispatch (``Participants.connect`` renewing its run lease,
``Participants.run_episode``; tests/fixtures/dispatching_trainer.py) running three long
episodes on a ``rollsafe env serve --hooks`` instance whose every turn appends to a ledger file
through ``session.effect`` (tests/fixtures/slow_ledger.py). Once each episode applied an
effect, the trainer is killed by its pid. Nothing cancels the episodes on the instance; its
run lease (1 s here, renewed every 0.2 s) is not renewed again, so each attempt is refused at
its next effect once it ran out: the attempts end long before their 2,000 turns, and no effect
began after the lease's expiry, by the instance's own clock. The time from the kill to the last
effect is printed (measured, not asserted: machines are noisy)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollsafe.env.client import EnvClient
from rollsafe.env.protocol import EffectsReply, EffectsRequest
from rollsafe.http.served import ENV_BANNER, ServedProcess, rollsafe_command
from rollsafe.testing.waiting import eventually

TOKEN = "lease-env-token"
FIXTURES = Path(__file__).parents[1] / "fixtures"
EPISODES, TURNS, LEASE_S = 3, 2000, 1.0
ROLLOUTS = tuple(f"killed-0_g{i}" for i in range(EPISODES))


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[tuple[ServedProcess, Path]]:
    ledger = tmp_path / "ledger.jsonl"
    args = ["env", "serve", "--hooks", "slow_ledger:SlowLedger", "--port", "0"]
    args += ["--instance", "slow", "--hooks-option", f"ledger={ledger}"]
    args += ["--hooks-option", "turn_s=0.05"]
    env = {"PYTHONPATH": str(FIXTURES), "ROLLSAFE_ENV_TOKEN": TOKEN}  # never on a command line
    server = ServedProcess(rollsafe_command(*args), tmp_path / "env", env)
    try:
        yield server.wait_listening(ENV_BANNER.format(name=r"\S+", instance="slow")), ledger
    finally:
        server.stop()


def ledger_lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def effects(url: str) -> EffectsReply:
    async def ask() -> EffectsReply:
        async with EnvClient(url, TOKEN) as client:
            return await client.effects(EffectsRequest(rollouts=ROLLOUTS))

    return asyncio.run(ask())


def stopped_effects(url: str) -> EffectsReply | None:
    """The instance's ledger of the rollouts once none of them runs any more."""
    reply = effects(url)
    return None if any(r.live_attempts for r in reply.rollouts) else reply


def test_a_killed_trainers_episodes_make_no_effect_once_its_run_lease_ran_out(
    instance: tuple[ServedProcess, Path],
) -> None:
    server, ledger = instance
    env = {**os.environ, "ROLLSAFE_ENV_TOKEN": TOKEN, "PYTHONPATH": str(FIXTURES)}
    script = FIXTURES / "dispatching_trainer.py"
    command = [sys.executable, str(script), server.url, str(EPISODES), str(TURNS), str(LEASE_S)]
    trainer = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert trainer.stdout is not None
        holder = trainer.stdout.readline().split()[-1]  # "lease <holder>"
        eventually(
            lambda: {str(e["key"]).split("/")[0] for e in ledger_lines(ledger)} >= set(ROLLOUTS),
            what="every episode applied an effect",
        )
    finally:
        trainer.send_signal(signal.SIGKILL)  # by its pid, mid-episode
        trainer.wait()
    killed = time.time()
    stopped = eventually(lambda: stopped_effects(server.url), what="its episodes stopped")
    assert stopped is not None
    expires = stopped.leases[holder]
    applied = [e for rollout in stopped.rollouts for e in rollout.applied]
    assert all(len(r.applied) < TURNS for r in stopped.rollouts)  # stopped, not finished
    late = [e for e in applied if e.applied_ts >= expires]
    assert not late, f"effects begun after the lease ran out at {expires}: {late}"
    assert len(ledger_lines(ledger)) == len(applied)  # the world saw exactly these
    last = max(e.applied_ts for e in applied)
    print(
        f"\nrun lease {LEASE_S:g} s: ran out {expires - killed:+.2f} s after the kill, last "
        f"effect began {last - killed:+.2f} s after it; {len(applied)} effects in all"
    )
