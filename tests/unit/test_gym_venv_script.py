"""``infra/gym-venv.sh`` (make setup's NeMo Gym venvs): a release it knows no Python for, and an
interpreter of the wrong version, are refused by name before anything is built; a venv that
already holds the release on the right Python is left as it is, silently (the warning about
Python 3.13.14 is printed once, when a venv is built)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rollsafe.gym.servers import GYM_EARLIER_VENV, GYM_VENV_DEFAULT, repo_root

SCRIPT = repo_root() / "infra" / "gym-venv.sh"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_a_release_without_a_known_python_is_refused_by_name(tmp_path: Path) -> None:
    done = _run(str(tmp_path / "venv"), "latest")
    assert done.returncode == 2 and "no Python known for nemo-gym latest" in done.stderr
    assert not (tmp_path / "venv").exists()


def test_an_interpreter_of_the_wrong_version_is_refused_by_name(tmp_path: Path) -> None:
    done = _run(str(tmp_path / "venv"), "0.7.0", sys.executable)  # this suite's 3.11
    assert done.returncode == 1, done.stderr
    assert "nemo-gym 0.7.0 needs Python 3.13" in done.stderr and "GYM_PYTHON" in done.stderr
    assert not (tmp_path / "venv").exists()


def test_a_venv_that_holds_the_release_is_left_as_it_is() -> None:
    for venv, release in ((GYM_VENV_DEFAULT, "0.7.0"), (GYM_EARLIER_VENV, "0.4.0")):
        done = _run(str(repo_root() / venv), release)
        assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), done.stderr
