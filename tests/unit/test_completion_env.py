"""The built-in completion environment's pure parts (rollsafe.env.completion): a task or a
record that is not one is refused naming the field, a record of another task is not continued,
and an episode's result becomes the training row the trainers read. Its cuts and restores run
end to end in tests/integration/test_trainers.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollsafe.engine.loop import HOLD_ENV, HoldRule
from rollsafe.engine.model import ModelConfig
from rollsafe.engine.torch_engine import TorchEngine
from rollsafe.env.completion import (
    CompletionEnv,
    CompletionRecord,
    CompletionTask,
    completion_row,
    parsed,
)
from rollsafe.env.participant import Participant
from rollsafe.env.protocol import (
    CommitRequest,
    EpisodeRef,
    EpisodeResult,
    PrepareRequest,
    RestoreRequest,
    ResumeRequest,
    RunEpisode,
)
from rollsafe.env.serve import ServeContext
from rollsafe.errors import InvalidInput
from rollsafe.testing.waiting import eventually_async

TASK = {"prompt": [5, 6, 7], "max_tokens": 4}
CONFIG = ModelConfig()


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


async def test_a_call_cut_while_parked_resumes_from_its_prefix_on_a_fresh_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The episode's call is held by the engine after 2 tokens, parked, cut, committed; a fresh
    instance restores it as attempt 1, which takes those 2 tokens from the prefix and ends with
    exactly the tokens an uncut run of the same rollout makes."""
    monkeypatch.setenv(HOLD_ENV, HoldRule(calls=r"_g0/t0$", after_tokens=2).model_dump_json())
    task = {"prompt": [5, 6, 7], "max_tokens": 6}
    ref = EpisodeRef(rollout_id="run-1_g0", attempt=0)
    async with TorchEngine(CONFIG, seed=0) as engine:
        first = Participant("c-0", CompletionEnv(ServeContext(engine=engine)))
        run = asyncio.ensure_future(first.run(RunEpisode(episode=ref, task=task)))
        await eventually_async(lambda: _held(engine), what="the call held")
        parked = await first.prepare(
            PrepareRequest(checkpoint_id="ck1", deadline_ts=time.time() + 5)
        )
        [episode] = parked.parked
        assert episode.activity == "generating" and episode.model_call_id is not None
        cut = await engine.cut([episode.model_call_id])
        [prefix] = cut.prefixes
        await first.commit(CommitRequest(checkpoint_id="ck1", scope=(ref,), dest=str(tmp_path)))
        run.cancel()

        fresh = Participant("c-0", CompletionEnv(ServeContext(engine=engine)))
        await fresh.restore(
            RestoreRequest(
                restore_id="r1",
                source_checkpoint_id="ck1",
                root=str(tmp_path),
                scope=(ref,),
                prefixes={prefix.call_id: prefix.model_dump(mode="json")},
                deadline_ts=time.time() + 5,
            )
        )
        await fresh.resume(ResumeRequest(checkpoint_id="r1"))  # the restore's own id
        resumed = await fresh.run(RunEpisode(episode=ref.next_attempt(), task=task))
        again = Participant("c-1", CompletionEnv(ServeContext(engine=engine)))
        uncut = await again.run(RunEpisode(episode=ref, task=task))  # the hold has ended
    assert resumed.info["attempt"]["resumed_tokens"] == len(prefix.tokens) == 2
    assert resumed.info["tokens"][:2] == list(prefix.tokens)
    assert resumed.info["tokens"] == uncut.info["tokens"] and len(uncut.info["tokens"]) == 6
    assert uncut.info["attempt"]["resumed_tokens"] == 0
    row = completion_row(resumed)
    assert row["tokens"].tolist() == resumed.info["tokens"]


async def _held(engine: TorchEngine) -> bool:
    return (await engine.info()).held > 0
