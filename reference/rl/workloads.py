"""What the reference run's episodes are: the task of each dataset index, the data-plane row a
finished episode becomes, and the training samples a row gives back.

Two workloads: ``workplace`` (rollsafe's own workplace environment, in token ids:
:mod:`rollsafe.reference.rl.rollouts`) and ``gym`` (NeMo Gym's workplace_assistant and
simple_agent behind rollsafe's gateway: :mod:`rollsafe.reference.rl.gym_workplace`). The
controller asks for tasks and rows, the trainer for samples; the rest of the run is the same.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from rollsafe.env.protocol import EpisodeResult
from rollsafe.evidence.files import EnvMutation
from rollsafe.reference.envs.workplace.calendar import Task
from rollsafe.reference.rl.rollouts import row_from_result, samples_from_row, task_for
from rollsafe.reference.rl.trainer import Sample

WorkloadName = Literal["workplace", "gym"]
MUTATIONS_COLUMN = "mutations"  # JSON of the episode's EnvMutation lines, as bytes


class Workload(Protocol):
    def task(self, group_idx: int) -> dict[str, Any]:
        """The task of dataset index ``group_idx`` (every sibling of the group gets it)."""
        ...

    def row(
        self, result: EpisodeResult, task: Mapping[str, Any], instance: str, rollout_id: str
    ) -> dict[str, np.ndarray]:
        """The row ``result`` is sealed as; its ``mutations`` column is the evidence of the
        effects the episode left in its environment (``env_mutations.jsonl``)."""
        ...

    def samples(self, rollout_id: str, row: Mapping[str, Any]) -> list[Sample]:
        """The training samples of a sealed row; a row that does not add up is refused."""
        ...


def mutations_column(mutations: Sequence[EnvMutation]) -> np.ndarray:
    lines = [m.model_dump(mode="json") for m in mutations]
    return np.frombuffer(json.dumps(lines).encode(), np.uint8)


def mutations_of_row(row: Mapping[str, Any]) -> list[EnvMutation]:
    return [EnvMutation.model_validate(m) for m in json.loads(bytes(row[MUTATIONS_COLUMN]))]


class WorkplaceWorkload:
    """rollsafe's workplace calendar: ``turns`` policy turns, each one action."""

    def __init__(self, turns: int) -> None:
        self.turns = turns

    def task(self, group_idx: int) -> dict[str, Any]:
        return task_for(group_idx, self.turns).model_dump()

    def row(
        self, result: EpisodeResult, task: Mapping[str, Any], instance: str, rollout_id: str
    ) -> dict[str, np.ndarray]:
        row = row_from_result(result, Task.model_validate(task))
        applied = result.info["mutations"]  # the final calendar's log: one per applied action
        row[MUTATIONS_COLUMN] = mutations_column(
            [
                EnvMutation(
                    instance=instance, rollout_id=rollout_id, turn=m["turn"], call_id=m["call_id"]
                )
                for m in applied
            ]
        )
        return row

    def samples(self, rollout_id: str, row: Mapping[str, Any]) -> list[Sample]:
        return samples_from_row(rollout_id, row)


def make_workload(name: WorkloadName, turns: int) -> Workload:
    if name == "gym":
        from rollsafe.reference.rl.gym_workplace import GymWorkload

        return GymWorkload()
    return WorkplaceWorkload(turns)
