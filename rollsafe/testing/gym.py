"""The NeMo Gym releases the suite runs, each in its own venv (``make setup`` builds both):
0.7, what NeMo RL ships (Python 3.13), and 0.4, the release before it (Python 3.12)."""

from __future__ import annotations

from pathlib import Path

from rollsafe.gym.servers import GYM_EARLIER_VENV, gym_python, gym_venv, repo_root

GYM_RELEASES = ("0.7", "0.4")


def gym_release_venv(release: str) -> Path:
    """The venv of ``release`` (one of :data:`GYM_RELEASES`; 0.7's is :func:`gym_venv`);
    :class:`rollsafe.errors.InvalidInput` naming ``make setup`` when it is missing, which a
    test lets fail rather than skip."""
    venv = {"0.7": gym_venv(), "0.4": repo_root() / GYM_EARLIER_VENV}[release]
    gym_python(venv)
    return venv
