"""rollsafe.integrations.trl's checks, on TRL's own objects (GRPOConfig, TrainerState): a
configuration its rollouts cannot serve, and a resumed checkpoint that is not this run's (saved
without rollsafe, another run's, another group shape) are refused by name before any step, and
the record a checkpoint carries comes back through TRL's own trainer_state.json; on a real
GRPOTrainer, a group's task is its dataset row's prompt, tokenized as TRL would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from datasets import Dataset
from transformers import TrainerControl, TrainerState
from trl.trainer.grpo_config import GRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer

from rollsafe.errors import CheckpointMismatch, InvalidInput
from rollsafe.integrations.trl import (
    LosslessRollouts,
    RunRecord,
    _check_prompts,
    _Tasks,
    prompt_ids,
)
from rollsafe.settings import Settings
from rollsafe.source import Batch


def config(tmp_path: Path, **fields: Any) -> GRPOConfig:
    base: dict[str, Any] = {
        "output_dir": str(tmp_path),
        "num_generations": 2,
        "per_device_train_batch_size": 4,
        "shuffle_dataset": False,
        "use_cpu": True,
        "report_to": [],
    }
    return GRPOConfig(**{**base, **fields})


def rollouts(run_id: str = "run-a") -> LosslessRollouts:
    return LosslessRollouts(Settings.load({"run_id": run_id}, env={}))


def resumed(tmp_path: Path, saved_by: LosslessRollouts | None, step: int = 4) -> TrainerState:
    """The state TRL loads from a checkpoint's trainer_state.json, as a resume does."""
    state = TrainerState(stateful_callbacks=[saved_by] if saved_by is not None else [])
    state.global_step = step
    state.save_to_json(str(tmp_path / "trainer_state.json"))
    return TrainerState.load_from_json(str(tmp_path / "trainer_state.json"))


def begin(callback: LosslessRollouts, args: GRPOConfig, state: TrainerState) -> None:
    callback.on_train_begin(args, state, TrainerControl())


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"shuffle_dataset": True}, r"shuffle_dataset=True; .* need shuffle_dataset=False"),
        ({"num_iterations": 2}, r"num_iterations=2"),
        ({"top_k": 5}, r"top_k=5"),
        ({"steps_per_generation": 2}, r"steps_per_generation=2: .* gradient_accumulation_steps=1"),
    ],
)
def test_a_configuration_the_rollouts_cannot_serve_is_named(
    tmp_path: Path, fields: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidInput, match=named):
        begin(rollouts(), config(tmp_path, **fields), TrainerState())


def test_a_checkpoint_saved_by_the_run_comes_back_as_its_record(tmp_path: Path) -> None:
    saver = rollouts()
    saver.on_train_begin(config(tmp_path), TrainerState(), TrainerControl())
    saver._resumed_at = 4  # what state() records at step 4 (no source in this test)
    state = resumed(tmp_path, saver)
    record = RunRecord.of(state)
    assert record == {"run_id": "run-a", "weight_version": 4, "group_size": 2, "groups_per_step": 2}
    begin(rollouts(), config(tmp_path), state)  # this run's: accepted


def test_a_checkpoint_saved_without_rollsafe_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointMismatch, match=r"step 4 was saved without rollsafe"):
        begin(rollouts(), config(tmp_path), resumed(tmp_path, None))


def test_another_runs_checkpoint_is_refused_naming_both(tmp_path: Path) -> None:
    other = rollouts("run-b")
    other.on_train_begin(config(tmp_path), TrainerState(), TrainerControl())
    other._resumed_at = 4
    with pytest.raises(CheckpointMismatch, match=r"run 'run-b', and this trainer is run 'run-a'"):
        begin(rollouts("run-a"), config(tmp_path), resumed(tmp_path, other))


def test_a_changed_num_generations_is_refused(tmp_path: Path) -> None:
    saver = rollouts()
    saver.on_train_begin(config(tmp_path), TrainerState(), TrainerControl())
    saver._resumed_at = 4
    state = resumed(tmp_path, saver)
    changed = config(tmp_path, num_generations=4, per_device_train_batch_size=8)
    with pytest.raises(CheckpointMismatch, match=r"num_generations=2 .* now has num_generations=4"):
        begin(rollouts(), changed, state)


def test_prompts_from_another_order_are_refused(tmp_path: Path) -> None:
    dataset = Dataset.from_dict({"prompt": [f"p{i}" for i in range(8)]})
    row = {"tokens": np.array([1], np.int64)}
    batch = Batch(1, (2, 3), {2: [row, row], 3: [row, row]}, {}, {})
    _check_prompts(batch, ["p2", "p2", "p3", "p3"], dataset, 8)  # the rows of groups 2 and 3
    with pytest.raises(InvalidInput, match=r"groups \[2, 3\] are dataset rows \[2, 3\]"):
        _check_prompts(batch, ["p5", "p5", "p3", "p3"], dataset, 8)


def test_the_rollout_func_without_the_callback_is_refused() -> None:
    with pytest.raises(InvalidInput, match=r"pass it as both \(callbacks=\[rollouts\]\)"):
        rollouts()._open(None)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> GRPOTrainer:
    """A real GRPOTrainer on a tiny model built here, with the rollouts as its rollout_func
    and callback (nothing trains: the tasks it would hand out are what is read)."""
    from rollsafe.engine.vllm.models import ModelSpec, make_model

    root = tmp_path_factory.mktemp("trl-trainer")
    model = make_model(root / "model", ModelSpec(seed=0))
    prompts = [f"prompt {i}" for i in range(5)]
    rollouts = LosslessRollouts(Settings.load({"run_id": "run-a"}, env={}))
    built = GRPOTrainer(
        model=str(model),
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=config(root, max_completion_length=7, temperature=0.7, top_p=0.9),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        rollout_func=rollouts,
        callbacks=[rollouts],
    )
    rollouts.on_train_begin(built.args, built.state, TrainerControl())
    return built


def test_a_groups_task_is_its_dataset_rows_prompt_tokenized_as_trl_would(
    trainer: GRPOTrainer,
) -> None:
    rollouts = next(
        cb for cb in trainer.callback_handler.callbacks if isinstance(cb, LosslessRollouts)
    )
    rows = rollouts._rows_per_epoch(trainer)
    assert rows == 4  # 5 prompts, 2 a step: TRL's sampler drops the last short step's
    tasks = _Tasks(trainer, rows)
    tokenizer = trainer.processing_class
    assert tasks(1)["prompt"] == tokenizer("prompt 1")["input_ids"]
    assert tasks(5) == tasks(1)  # the next epoch, in the same order
    assert {k: tasks(0)[k] for k in ("max_tokens", "temperature", "top_p")} == {
        "max_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
    }
    assert tokenizer.eos_token_id in tasks(0)["stop"]
    chat = [{"role": "user", "content": "hello"}]
    ids = prompt_ids(tokenizer, chat, {})
    templated = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert ids == templated["input_ids"]  # transformers 5 answers a dict


def test_a_streaming_dataset_is_refused_by_name(trainer: GRPOTrainer) -> None:
    rollouts = next(
        cb for cb in trainer.callback_handler.callbacks if isinstance(cb, LosslessRollouts)
    )
    streaming = trainer.train_dataset.to_iterable_dataset()
    original, trainer.train_dataset = trainer.train_dataset, streaming
    try:
        with pytest.raises(InvalidInput, match=r"IterableDataset: .* map-style one"):
            rollouts._rows_per_epoch(trainer)
    finally:
        trainer.train_dataset = original
