"""The reference run's prompts and rollouts: a built-in task set, one data-plane row per
finished episode, and the training samples a row replays into.

A row stores what the episode generated, turn by turn, and its task; the prompts are not
stored because the workplace calendar is pure: replaying the turns' tokens from the task
recomputes every prompt the environment showed the policy (and its reward, which is checked).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rollsafe.env.protocol import EpisodeResult
from rollsafe.errors import InvalidInput
from rollsafe.reference.envs.workplace.calendar import Task, action_from_tokens, apply, new_calendar
from rollsafe.reference.envs.workplace.calendar import prompt as make_prompt
from rollsafe.reference.envs.workplace.calendar import reward as score
from rollsafe.reference.rl.trainer import Sample

TASK_TURNS = 4


def task_for(group_idx: int, turns: int = TASK_TURNS) -> Task:
    """The prompt of dataset index ``group_idx``: the same index, the same task, every run."""
    seed = int.from_bytes(hashlib.sha256(f"task:{group_idx}".encode()).digest()[:4], "big") >> 1
    return Task(seed=seed, meetings=2 + group_idx % 3, turns=turns)


def row_from_result(result: EpisodeResult, task: Task) -> dict[str, np.ndarray]:
    history = result.info["history"]
    turn_tokens = [list(turn["tokens"]) for turn in history]
    return {
        "task": np.array([task.seed, task.meetings, task.turns], np.int64),
        "tokens": np.array([t for turn in turn_tokens for t in turn], np.int32),
        "turn_lengths": np.array([len(turn) for turn in turn_tokens], np.int32),
        "reward": np.array(result.reward, np.float32),
        "restored_prefix_tokens": np.array(
            sum(result.info["attempt"]["resumed_from"].values()), np.int32
        ),
    }


def samples_from_row(rollout_id: str, row: Mapping[str, Any]) -> list[Sample]:
    """One sample per turn, each with its episode's reward (siblings share a task, so every
    rollout of a group has as many turns: the group's advantages are the episodes')."""
    seed, meetings, turns = (int(v) for v in row["task"])
    task = Task(seed=seed, meetings=meetings, turns=turns)
    lengths = [int(n) for n in row["turn_lengths"]]
    tokens = [int(t) for t in row["tokens"]]
    if sum(lengths) != len(tokens) or len(lengths) != turns:
        raise InvalidInput(f"{rollout_id}: row's turns do not add up to its tokens")
    calendar, samples, start = new_calendar(task), [], 0
    reward = float(row["reward"])
    for turn, length in enumerate(lengths):
        generated = tuple(tokens[start : start + length])
        start += length
        samples.append(
            Sample(prompt_tokens=make_prompt(task, calendar, turn), tokens=generated, reward=reward)
        )
        action = action_from_tokens(generated, calendar)
        calendar = apply(
            calendar, action, rollout_id=rollout_id, turn=turn, call_id=f"replay/{turn}"
        )
    if abs(score(calendar, task) - reward) > 1e-6:
        raise InvalidInput(f"{rollout_id}: replaying the row gives another reward than sealed")
    return samples


def mutations_of(result: EpisodeResult) -> list[dict[str, Any]]:
    """The mutations the episode's environment applied (its final calendar's log)."""
    return [dict(m) for m in result.info["mutations"]]


def group_samples(rows: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Sample]:
    return [sample for rollout_id, row in rows for sample in samples_from_row(rollout_id, row)]
