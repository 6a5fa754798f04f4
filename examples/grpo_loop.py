"""Bring your own training loop: GRPO on the engine's own model, its rollouts from
``rollsafe.RolloutSource`` (docs/integrating.md, "The rollout source").

The policy is the Hugging Face model the run's engine serves (``rollsafe engine serve --backend
vllm --model DIR``); each rollout is one completion of a prompt, an episode of the built-in
``completion`` environment (``rollsafe env serve completion``). Every step is a real optimizer
step (SGD on the group-relative advantages), its weights go to the engine, and a checkpoint of
them is saved. Settings come from rollsafe.Settings (ROLLSAFE_* variables or the file
ROLLSAFE_CONFIG names): run id, snapshot root, run shape, the participants' URLs.

    python examples/grpo_loop.py --model DIR --steps 4 --trainer-dir /tmp/trainer

Kill it at any moment and start it again with the same arguments: the source restores the run
at the newest checkpoint the trainer holds, and the loop goes on from there, nothing generated
again that was finished and no group trained twice.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import rollsafe

PROMPT_TOKENS, MAX_TOKENS, LR = 6, 8, 0.05


def task(idx: int) -> dict[str, Any]:
    """Dataset index ``idx``'s prompt: the same index, the same prompt, in every process."""
    seed = int.from_bytes(hashlib.sha256(f"prompt:{idx}".encode()).digest()[:4], "big")
    prompt = np.random.default_rng(seed).integers(3, 256, PROMPT_TOKENS)
    return {"prompt": prompt.tolist(), "max_tokens": MAX_TOKENS}


def to_row(result: rollsafe.EpisodeResult) -> rollsafe.Row:
    """A rollout's training row (named numpy arrays), sealed into the run's data plane."""
    info = result.info
    return {
        "prompt": np.array(info["prompt"], np.int64),
        "tokens": np.array(info["tokens"], np.int64),
        "restored_prefix_tokens": np.array(info["attempt"]["resumed_tokens"], np.int64),
    }


def reward(row: rollsafe.Row) -> float:
    """The task's score: the share of the completion's tokens below 256 (a "language")."""
    return float((row["tokens"] < 256).mean())


class Policy:
    """The engine's model under SGD, and its checkpoints ``v<version>.safetensors`` (the whole
    trainer state: plain SGD keeps none besides the weights)."""

    def __init__(self, model_dir: Path, directory: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def versions(self) -> list[int]:
        return sorted(int(path.stem[1:]) for path in self.dir.glob("v*.safetensors"))

    def save(self, version: int) -> Path:
        path = self.dir / f"v{version}.safetensors"
        save_file(self.model.state_dict(), path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)  # a checkpoint is whole or absent
        return path

    def load(self, version: int) -> None:
        """Back to checkpoint ``version``; newer ones (a lineage the restore rolled back) go."""
        self.model.load_state_dict(load_file(self.dir / f"v{version}.safetensors"))
        for newer in [v for v in self.versions() if v > version]:
            (self.dir / f"v{newer}.safetensors").unlink()

    def train(self, rows: dict[int, list[rollsafe.Row]]) -> float:
        """One GRPO step: each completion's log-likelihood weighted by its group-relative
        advantage (reward minus the group's mean, over its std)."""
        self.optimizer.zero_grad()
        losses = []
        for siblings in rows.values():
            rewards = torch.tensor([reward(row) for row in siblings])
            advantages = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
            for row, advantage in zip(siblings, advantages, strict=True):
                prompt, tokens = torch.from_numpy(row["prompt"]), torch.from_numpy(row["tokens"])
                logits = self.model(torch.cat([prompt, tokens])[None]).logits[
                    0, len(prompt) - 1 : -1
                ]
                logprob = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).mean()
                losses.append(-advantage * logprob)
        loss = torch.stack(losses).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        return float(loss)


async def run(args: argparse.Namespace) -> None:
    policy = Policy(args.model, args.trainer_dir)
    if not policy.versions():
        policy.save(0)  # the base model: a restart before the first step restores to it
    held = policy.versions()
    source = rollsafe.RolloutSource(
        task=task, to_row=to_row, weight_versions=held, evidence=args.evidence
    )
    async with source:
        policy.load(source.weight_version)  # the checkpoint the restore chose (0: the base model)
        if source.plan is not None:  # a restart: the engines may serve other weights
            await source.set_weights(policy.model.state_dict())
            print(f"[restore] weight version {source.weight_version}", flush=True)
        while source.weight_version < args.steps:
            batch = await source.batch()
            loss = policy.train(batch.rows)
            path = policy.save(batch.step + 1)
            await source.step_done(batch.step + 1, path, weights=policy.model.state_dict())
            print(f"[step {batch.step}] groups {list(batch.groups)}, loss {loss:+.4f}", flush=True)
    print(f"[done] {args.steps} steps", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the engine's model directory")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps to train")
    parser.add_argument("--trainer-dir", type=Path, required=True, help="trainer checkpoints")
    parser.add_argument("--evidence", type=Path, help="the run's evidence (rollsafe verify DIR)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
