"""``rollsafe env-check`` against what breaks exactly once, on a third party's game: textarena's
Mastermind (``reference/envs/mastermind.py``), every guess submitted through ``session.effect``
to an append-only ledger file that keeps duplicates, served with ``rollsafe env serve --hooks
... --hooks-option ledger=PATH`` as an author would, beside its broken twins
(``reference/envs/lossy.py``). The honest one passes every check and its ledger holds each
(rollout, turn) once; the twin that names its effect after the attempt fails on effects applied
twice (and its ledger shows them), the one that loses textarena's hidden history fails on the
state digest alone, the one whose info carries only its own run's guesses fails on the training
row. Each env-check runs as its own process, all four at once."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollsafe.http.served import ENGINE_BANNER, ENV_BANNER, ServedProcess, rollsafe_command
from rollsafe.testing.envs import failed_checks

ENGINE_TOKEN = "fx-engine-token"
ENV_TOKEN = "fx-env-token"
# Played out: the rollout ids env-check makes are its own (random), so are the guesses; one
# that cracked the code within 2 turns left a task too short to check (it happened in CI).
TASK = {"seed": 3, "turns": 12, "play_out": True}
ENVS = {
    "honest": "rollsafe.reference.envs.mastermind:Mastermind",
    "resubmitting": "rollsafe.reference.envs.lossy:ResubmittingMastermind",
    "forgetful": "rollsafe.reference.envs.lossy:ForgetfulMastermind",
    "row-changing": "rollsafe.reference.envs.lossy:RowChangingMastermind",
}


class Served:
    """The engine, the instances by name, where their ledgers are."""

    def __init__(self, engine: ServedProcess, envs: dict[str, ServedProcess], logs: Path):
        self.engine, self.envs, self.logs = engine, envs, logs

    def ledger(self, name: str) -> list[dict[str, object]]:
        path = self.logs / f"{name}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """An engine and one instance per environment, each with its own ledger file."""
    logs = tmp_path_factory.mktemp("effects")
    started: list[ServedProcess] = []
    try:
        tokens = {"ROLLSAFE_ENGINE_TOKEN": ENGINE_TOKEN, "ROLLSAFE_ENV_TOKEN": ENV_TOKEN}
        command = rollsafe_command("engine", "serve", "--port", "0")
        started.append(engine := ServedProcess(command, logs / "engine", tokens))
        engine.wait_listening(ENGINE_BANNER.format(kind="dense"))
        envs: dict[str, ServedProcess] = {}
        for name, hooks in ENVS.items():
            args = ["env", "serve", "--hooks", hooks, "--port", "0", "--engine-url", engine.url]
            args += ["--instance", name, "--lease-grace-s", "1"]
            args += ["--hooks-option", f"ledger={logs / name}.jsonl"]
            started.append(
                envs.setdefault(name, ServedProcess(rollsafe_command(*args), logs / name, tokens))
            )
        for name, server in envs.items():
            server.wait_listening(ENV_BANNER.format(name=r"\S+", instance=name))
        yield Served(engine, envs, logs)
    finally:
        for server in reversed(started):
            server.stop()


@pytest.fixture(scope="module")
def checked(served: Served) -> dict[str, subprocess.CompletedProcess[str]]:
    """``rollsafe env-check`` of every instance, all at once; each one's outcome."""
    env = {**os.environ, "ROLLSAFE_ENV_TOKEN": ENV_TOKEN, "ROLLSAFE_ENGINE_TOKEN": ENGINE_TOKEN}
    running = {}
    for name, server in served.envs.items():
        command = rollsafe_command("env-check", server.url, "--task", json.dumps(TASK))
        command += ["--engine-url", served.engine.url, "--lease-wait-s", "2"]
        running[name] = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
    done = {}
    for name, process in running.items():
        out, err = process.communicate(timeout=240)
        done[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return done


def twice(entries: list[dict[str, object]]) -> list[tuple[str, str]]:
    """(rollout, turn) pairs the ledger holds more than once."""
    keys = Counter(tuple(str(e["key"]).split("/")[:2]) for e in entries)
    return sorted(k for k, n in keys.items() if n > 1)  # type: ignore[misc]


def test_the_honest_game_passes_every_check_and_submits_each_guess_once(
    served: Served, checked: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    done = checked["honest"]
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all checks passed" in done.stdout and "not compared" not in done.stdout
    abandoned = next(line for line in done.stdout.splitlines() if "PASS abandoned" in line)
    assert "effect(s) applied once each, by attempt(s) [0" in abandoned, abandoned
    entries = served.ledger("honest")
    assert entries and twice(entries) == []


def test_effects_named_after_the_attempt_are_applied_twice_and_fail(
    served: Served, checked: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    done = checked["resubmitting"]
    assert done.returncode == 1, done.stdout + done.stderr
    found = failed_checks(done.stdout)
    assert set(found) == {"restore", "cut_resume", "abandoned"}, done.stdout
    for detail in found.values():
        assert "effects applied that the finished attempt did not ask for" in detail, detail
        assert "never the attempt" in detail
    assert twice(served.ledger("resubmitting"))  # the ledger agrees: guesses submitted twice


@pytest.mark.parametrize(
    ("twin", "named"),
    [
        # Hidden state lost: the pegs, the reward and the info are the same; the digest not.
        ("forgetful", "differs from the uninterrupted attempt's (state_digest"),
        ("row-changing", "its info differs from the uninterrupted attempt's: info.guesses:"),
    ],
)
def test_lost_hidden_state_and_a_different_training_row_fail_the_restore_checks(
    checked: dict[str, subprocess.CompletedProcess[str]], twin: str, named: str
) -> None:
    done = checked[twin]
    assert done.returncode == 1, done.stdout + done.stderr
    found = failed_checks(done.stdout)
    assert set(found) == {"restore", "cut_resume"}, done.stdout
    for detail in found.values():
        assert named in detail, detail
