"""TRL's GRPOTrainer, lossless across crashes: its rollouts come from a rollsafe run
(``pip install 'rollsafe[trl]'``; docs/integrating.md, "TRL").

::

    from rollsafe.integrations.trl import LosslessRollouts

    rollouts = LosslessRollouts(settings)  # rollsafe.Settings: run id, root, participants
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(..., shuffle_dataset=False),
                          train_dataset=dataset, rollout_func=rollouts, callbacks=[rollouts])
    trainer.train(resume_from_checkpoint=...)          # None for a new run; a checkpoint to resume

It is the trainer's ``rollout_func`` (TRL's own seam for a generation backend) and one of its
callbacks. Each prompt group is a rollsafe group, generated ``ahead_steps`` steps ahead on the
run's environments (one ``completion`` episode per rollout: ``rollsafe env serve completion``)
and engines, so a snapshot parks, cuts and commits it. Each optimizer step commits the step's
groups (``on_step_end``) and sends the new weights to the engines; each of TRL's ``save_steps``
checkpoints anchors a snapshot (``on_save``) and carries the run's record in its
``trainer_state.json``; ``trainer.train(resume_from_checkpoint=...)`` restores the run at that
checkpoint's step: nothing finished is generated again, a call cut in flight resumes from its
prefix, no group is trained twice or skipped.

What it asks of TRL's configuration, each refused by name otherwise: one process; prompts in
dataset order (``shuffle_dataset=False``: shuffle the dataset once, with a seed, instead); one
generation per optimizer step, used once (``steps_per_generation`` equal to
``gradient_accumulation_steps``, ``num_iterations=1``); no vLLM of TRL's own
(``use_vllm=False``: the run's engines generate); sampling rollsafe's engines reproduce on a
resume (``temperature``, ``top_p``, ``max_completion_length``; not ``top_k``, ``min_p`` or
``repetition_penalty``).

AsyncGRPOTrainer (``trl.experimental.async_grpo``) needs CUDA (its constructor asks
``torch.cuda`` for the device's name; its training forward is tree attention on the Hub's FA3
kernel), so this GRPOTrainer path is the one tested on CPU; docs/integrating.md says how its
``rollout_worker`` and ``weight_transfer`` seams take the same source.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollsafe.core.phases import Phase
from rollsafe.env.completion import completion_row
from rollsafe.errors import CheckpointMismatch, ExtraNotInstalled, InvalidInput
from rollsafe.settings import Settings
from rollsafe.source import Batch, SyncRolloutSource

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import ExportableState
except ImportError:  # pragma: no cover - the extra is what brings them
    raise ExtraNotInstalled("rollsafe.integrations.trl (TRL, transformers)", "trl") from None

if TYPE_CHECKING:
    from trl.trainer.grpo_trainer import GRPOTrainer

__all__ = ["LosslessRollouts", "RunRecord"]

log = logging.getLogger(__name__)
CUT = Phase.CUT_GENERATION
# What GRPOConfig must hold for rollsafe's groups to be TRL's (module docstring): name -> value.
REQUIRED_ARGS: Mapping[str, Any] = {
    "shuffle_dataset": False,
    "num_iterations": 1,
    "use_vllm": False,
    "top_k": 0,
    "min_p": None,
    "repetition_penalty": 1.0,
}


class RunRecord(dict[str, Any]):
    """The run a TRL checkpoint belongs to, in its ``trainer_state.json`` (the callback's
    ``stateful_callbacks`` entry): ``run_id``, ``weight_version`` (its global step),
    ``group_size`` and ``groups_per_step``."""

    @classmethod
    def of(cls, state: TrainerState) -> RunRecord | None:
        entry = (state.stateful_callbacks or {}).get(LosslessRollouts.__name__)
        if not isinstance(entry, dict) or not isinstance(entry.get("attributes"), dict):
            return None
        return cls(entry["attributes"])


class LosslessRollouts(TrainerCallback, ExportableState):  # type: ignore[misc]
    """GRPOTrainer's ``rollout_func`` and a callback of it, in one object (module docstring).
    ``settings``: rollsafe's (default :meth:`Settings.load`); the run's shape (``group_size``,
    ``groups_per_step``, the ``in_order`` sampler) is taken from TRL's arguments. ``evidence``:
    a directory for the run's evidence (``rollsafe verify DIR``). ``start_over``: a run that has
    snapshots starts again from nothing instead of refusing a trainer that did not resume."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        ahead_steps: int = 1,
        evidence: Path | str | None = None,
        start_over: bool = False,
        wait_for_snapshots: bool = True,
    ) -> None:
        self.settings = settings if settings is not None else Settings.load()
        self.run_id = self.settings.require_run_id()
        self.ahead_steps, self.evidence, self.start_over = ahead_steps, evidence, start_over
        self.wait_for_snapshots = wait_for_snapshots  # on_save waits for its anchored snapshot
        self.source: SyncRolloutSource | None = None
        self._resumed_at = 0
        self._shape: tuple[int, int] | None = None  # (group_size, groups_per_step)

    # ---- GRPOTrainer's rollout_func --------------------------------------------------------

    def __call__(self, prompts: Sequence[Any], trainer: GRPOTrainer) -> dict[str, list[Any]]:
        """The completions of the step's prompts (``num_generations`` copies of each, as TRL
        passes them): the next batch of the run, checked to be these very prompts."""
        source = self.source or self._open(trainer)
        batch = source.batch()
        _check_prompts(batch, prompts, trainer.train_dataset, self._rows_per_epoch(trainer))
        rows = [row for idx in batch.groups for row in batch.rows[idx]]
        return {
            "prompt_ids": [row["prompt"].tolist() for row in rows],
            "completion_ids": [row["tokens"].tolist() for row in rows],
            "logprobs": [row["logprobs"].tolist() for row in rows],
        }

    # ---- callbacks -------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        """Check TRL's arguments, and that a resumed checkpoint is this run's, before any
        step: nothing is changed when either is refused."""
        self._shape = _shape(args)
        self._resumed_at = state.global_step
        if state.global_step > 0:
            self._check_record(RunRecord.of(state), state.global_step)

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        **_: Any,
    ) -> None:
        """The optimizer step committed: weight version ``global_step``; the engines get it."""
        assert self.source is not None, "a step ended before its rollout_func ran"
        weights = None if model is None else model.state_dict()
        self.source.step_done(state.global_step, weights=weights)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        """TRL saved ``checkpoint-<step>``: a snapshot anchored to it."""
        assert self.source is not None
        path = checkpoint_dir(args.output_dir, state.global_step)
        outcome = self.source.checkpoint_saved(
            state.global_step, path, wait=self.wait_for_snapshots
        )
        if outcome is not None:
            cut = sum(p.counts.get("cut", 0) for p in outcome.phases if p.phase == CUT)
            log.info(
                "run %s: snapshot at weight version %d %s, %d calls cut",
                self.run_id,
                state.global_step,
                outcome.status,
                cut,
            )

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        self.close()

    def state(self) -> dict[str, Any]:
        """Saved in each checkpoint's ``trainer_state.json`` (``ExportableState``)."""
        group_size, per_step = self._shape or (0, 0)
        version = self.source.weight_version if self.source is not None else self._resumed_at
        attributes = RunRecord(
            run_id=self.run_id,
            weight_version=version,
            group_size=group_size,
            groups_per_step=per_step,
        )
        return {"args": {}, "attributes": dict(attributes)}

    def close(self) -> None:
        """End the run's checkpointing (at the end of ``train``)."""
        if self.source is not None:
            source, self.source = self.source, None
            source.close()

    # ---- helpers ---------------------------------------------------------------------------

    def _check_record(self, record: RunRecord | None, step: int) -> None:
        resumed = f"the checkpoint at step {step}"
        if record is None:
            raise CheckpointMismatch(
                f"{resumed} was saved without rollsafe (its trainer_state.json holds no "
                f"{type(self).__name__} record): resume it without rollsafe, or start a new "
                "rollsafe run (another run_id) with start_over=True"
            )
        if record.get("run_id") != self.run_id:
            raise CheckpointMismatch(
                f"{resumed} belongs to rollsafe run {record.get('run_id')!r}, and this trainer "
                f"is run {self.run_id!r} (settings run_id): resume it under its own run id"
            )
        assert self._shape is not None
        saved = (record.get("group_size"), record.get("groups_per_step"))
        if saved != self._shape:
            raise CheckpointMismatch(
                f"{resumed} was trained with num_generations={saved[0]} and {saved[1]} prompts "
                f"a step; the trainer now has num_generations={self._shape[0]} and "
                f"{self._shape[1]}: a run's groups keep their shape (start a new run to change it)"
            )
        if record.get("weight_version") != step:
            raise CheckpointMismatch(
                f"{resumed} records weight version {record.get('weight_version')}, not {step}"
            )

    def _open(self, trainer: GRPOTrainer) -> SyncRolloutSource:
        """The run's source, restored at the step the trainer resumed from, serving the
        trainer's weights."""
        if self._shape is None:
            raise InvalidInput(
                f"{type(self).__name__} is the rollout_func and a callback of the trainer: pass "
                "it as both (callbacks=[rollouts])"
            )
        group_size, per_step = self._shape
        self.source = SyncRolloutSource(
            self.settings,
            task=_Tasks(trainer, self._rows_per_epoch(trainer)),
            to_row=completion_row,
            weight_versions=[self._resumed_at],
            ahead_steps=self.ahead_steps,
            start_over=self.start_over,
            must_restore=self._resumed_at > 0,
            evidence=self.evidence,
            run={"group_size": group_size, "groups_per_step": per_step, "sampler": "in_order"},
        )
        if self.source.plan is not None:
            plan = self.source.plan
            log.info(
                "run %s restored at step %d: %d groups ready, %d to generate",
                self.run_id,
                plan.weight_version,
                len(plan.ready),
                len(plan.redispatch),
            )
        self.source.set_weights(trainer.accelerator.unwrap_model(trainer.model).state_dict())
        return self.source

    def _rows_per_epoch(self, trainer: GRPOTrainer) -> int:
        """Dataset rows an epoch hands out: TRL's sampler drops a last short step's prompts."""
        assert self._shape is not None
        per_step, dataset = self._shape[1], trainer.train_dataset
        if not hasattr(dataset, "__len__"):  # a group's prompt is found by its index
            raise InvalidInput(
                f"the train dataset is a {type(dataset).__name__}: rollsafe's rollouts need a "
                "map-style one (datasets.Dataset), whose rows an index finds"
            )
        rows = (len(dataset) // per_step) * per_step
        if rows == 0:
            raise InvalidInput(
                f"the dataset's {len(dataset)} prompts are fewer than a step's {per_step}"
            )
        return rows


class _Tasks:
    """Group ``idx``'s task: the prompt of dataset row ``idx % rows`` (TRL's order without
    shuffling, epoch after epoch), tokenized as TRL would, with TRL's sampling."""

    def __init__(self, trainer: GRPOTrainer, rows: int) -> None:
        args = trainer.args
        self.dataset, self.rows = trainer.train_dataset, rows
        self.tokenizer = trainer.processing_class
        self.template = dict(getattr(args, "chat_template_kwargs", None) or {})
        self.sampling = {
            "max_tokens": int(args.max_completion_length),
            "temperature": float(args.temperature),
            "top_p": float(args.top_p),
            "stop": [int(t) for t in trainer.eos_token_ids if t is not None],
        }

    def __call__(self, idx: int) -> dict[str, Any]:
        prompt = self.dataset[idx % self.rows]["prompt"]
        return {"prompt": prompt_ids(self.tokenizer, prompt, self.template), **self.sampling}


def prompt_ids(tokenizer: Any, prompt: Any, template: Mapping[str, Any]) -> list[int]:
    """A prompt's token ids: a conversation through the chat template (generation prompt
    added), a plain string as is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    ids = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=False, **template
    )
    return [int(t) for t in ids]


def _shape(args: TrainingArguments) -> tuple[int, int]:
    """(group_size, groups_per_step) from GRPOConfig, after checking what rollsafe needs."""
    wrong = {
        name: getattr(args, name, value)
        for name, value in REQUIRED_ARGS.items()
        if getattr(args, name, value) != value
    }
    if wrong:
        found = ", ".join(f"{name}={value!r}" for name, value in wrong.items())
        needed = ", ".join(f"{name}={REQUIRED_ARGS[name]!r}" for name in wrong)
        raise InvalidInput(f"GRPOConfig has {found}; rollsafe's rollouts need {needed}")
    if args.world_size != 1:
        raise InvalidInput(f"rollsafe's rollouts serve one training process, not {args.world_size}")
    if args.steps_per_generation != args.gradient_accumulation_steps:
        raise InvalidInput(
            f"GRPOConfig has steps_per_generation={args.steps_per_generation}: rollsafe's "
            "rollouts make one generation per optimizer step, so it must equal "
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}"
        )
    group_size = int(args.num_generations)
    return group_size, int(args.generation_batch_size) // group_size


def _check_prompts(batch: Batch, prompts: Sequence[Any], dataset: Any, rows: int) -> None:
    """TRL's prompts for this step are the batch's groups' rows, each ``group_size`` times: a
    dataloader that went another way (shuffled, another dataset) is named, never trained on."""
    size = len(prompts) // max(1, len(batch.groups))
    expected = [dataset[idx % rows]["prompt"] for idx in batch.groups]
    given = [prompts[j * size] for j in range(len(batch.groups))]
    if len(prompts) != size * len(batch.groups) or given != expected:
        raise InvalidInput(
            f"step {batch.step}: TRL's dataloader gave prompts {given!r}, and the run's groups "
            f"{list(batch.groups)} are dataset rows {[idx % rows for idx in batch.groups]} "
            f"({expected!r}): the dataloader's order changed (shuffle_dataset, the dataset, a "
            "checkpoint of another run)"
        )


def checkpoint_dir(output_dir: str | os.PathLike[str], step: int) -> Path:
    """Where TRL saves the checkpoint of ``step``."""
    return Path(output_dir) / f"checkpoint-{step}"
