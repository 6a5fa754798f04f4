"""The built-in completion environment's pure parts (rollsafe.env.completion): a task or a
record that is not one is refused naming the field, a record of another task is not continued,
and an episode's result becomes the training row the trainers read. Its cuts and restores run
end to end in tests/integration/test_trainers.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rollsafe.env.completion import (
    CompletionEnv,
    CompletionRecord,
    CompletionTask,
    completion_row,
    parsed,
)
from rollsafe.env.protocol import EpisodeRef, EpisodeResult
from rollsafe.env.serve import ServeContext
from rollsafe.errors import InvalidInput

TASK = {"prompt": [5, 6, 7], "max_tokens": 4}


@pytest.mark.parametrize(
    ("task", "named"),
    [
        ({"prompt": [], "max_tokens": 4}, r"prompt: .*at least 1"),
        ({"prompt": [5, -1], "max_tokens": 4}, r"prompt\.1: .*greater than or equal to 0"),
        ({"prompt": [5, True], "max_tokens": 4}, r"prompt\.1: .*valid integer"),
        ({"prompt": [5], "max_tokens": 0}, r"max_tokens: .*greater than or equal to 1"),
        ({**TASK, "top_k": 3}, r"top_k: Extra inputs are not permitted"),
    ],
)
def test_a_bad_task_is_refused_naming_the_field(task: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidInput, match=rf"bad completion CompletionTask: {named}"):
        parsed(CompletionTask, task)


def test_a_record_of_another_format_refuses_the_restore() -> None:
    env = CompletionEnv.__new__(CompletionEnv)  # the hook needs no engine
    episode = EpisodeRef(rollout_id="run-1_g0", attempt=0)
    record = CompletionRecord(task=parsed(CompletionTask, TASK)).model_dump(mode="json")
    env.restore_episode(episode, record)
    with pytest.raises(InvalidInput, match=r"format: Input should be 'completion/1'"):
        env.restore_episode(episode, {**record, "format": "completion/2"})


def test_the_environment_needs_an_engine() -> None:
    with pytest.raises(InvalidInput, match="needs --engine-url"):
        CompletionEnv(ServeContext(engine=None))


def test_a_result_becomes_its_training_row() -> None:
    info = {
        "prompt": [5, 6, 7],
        "tokens": [9, 10],
        "logprobs": [-0.5, -1.5],
        "finish_reason": "length",
        "attempt": {"resumed_tokens": 1},
    }
    episode = EpisodeRef(rollout_id="run-1_g0", attempt=1)
    row = completion_row(
        EpisodeResult(episode=episode, reward=0.0, turns=1, restored=True, info=info)
    )
    assert row["prompt"].tolist() == [5, 6, 7] and row["tokens"].tolist() == [9, 10]
    assert row["logprobs"].dtype == np.float32 and int(row["restored_prefix_tokens"]) == 1
