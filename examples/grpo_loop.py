"""Bring your own rollout loop: a GRPO-style loop under rollsafe (docs/integrating.md).

The run's controller lives in this process, with the run's environment instances and engine as
its participants, and a checkpoint worker runs beside the loop: a Temporal server and the
servers are all it needs (no Ray). Its settings come from rollsafe.Settings (ROLLSAFE_* variables
or the file ROLLSAFE_CONFIG names): run id, snapshot root, run shape, the participants' URLs.

    python examples/grpo_loop.py --steps 4 --trainer-dir /tmp/trainer

Kill it at any moment and start it again with the same arguments: it restores the newest
snapshot at a weight version it holds a trainer checkpoint of, and goes on from there. The
trainer is a stand-in (GRPO advantages, no optimizer): put yours where ``train`` is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np

import rollsafe


def to_row(result: rollsafe.EpisodeResult) -> rollsafe.Row:
    """A rollout's training row: named numpy arrays, sealed into the run's data plane."""
    tokens = [t for turn in result.info["history"] for t in turn["tokens"]]
    return {"tokens": np.array(tokens, np.int32), "reward": np.array(result.reward, np.float32)}


def train(step: int, rows: dict[int, list[rollsafe.Row]]) -> list[dict[str, Any]]:
    """The stand-in trainer: each group's GRPO advantages (reward minus the group's mean)."""
    trained = []
    for group, siblings in rows.items():
        rewards = np.array([float(row["reward"]) for row in siblings])
        advantages = (rewards - rewards.mean()).round(6).tolist()
        tokens = [int(row["tokens"].size) for row in siblings]
        trained.append({"step": step, "group": group, "advantages": advantages, "tokens": tokens})
    return trained


class Trainer:
    """The trainer's checkpoints: ``v<weight version>.json``, each the whole history so far."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.history: list[dict[str, Any]] = []

    def versions(self) -> list[int]:
        return sorted(int(path.stem[1:]) for path in self.dir.glob("v*.json"))

    def save(self, version: int) -> str:
        path = self.dir / f"v{version}.json"
        path.with_suffix(".tmp").write_text(json.dumps(self.history))
        path.with_suffix(".tmp").replace(path)  # a checkpoint is whole or absent
        return str(path)

    def load(self, version: int) -> list[int]:
        """Back to checkpoint ``version``; the newer ones, a lineage the restore rolled back,
        are deleted (and returned)."""
        self.history = json.loads((self.dir / f"v{version}.json").read_text())
        newer = [v for v in self.versions() if v > version]
        for stale in newer:
            (self.dir / f"v{stale}.json").unlink()
        return newer


async def episode(rollouts: rollsafe.Rollouts, group: int, sibling: int, args: Any) -> None:
    dispatched = await rollouts.dispatch(group, sibling)  # waits while a snapshot parks the run
    if args.verbose:
        print(f"[episode] {dispatched.key} dispatched", flush=True)
    task = {"seed": group, "meetings": 2, "turns": args.turns}  # the workplace environment's
    await rollouts.run_episode(dispatched, task, to_row)  # resumes a restored episode


async def run(args: argparse.Namespace) -> None:  # noqa: C901, PLR0912 (a tutorial's loop, read top to bottom)
    settings = rollsafe.Settings.load()
    controller = rollsafe.Controller.from_settings(settings)
    rollouts, ckpt = rollsafe.Rollouts(controller), rollsafe.Checkpointer(settings=settings)
    per_step = settings.run_config().groups_per_step
    trainer, running, rolled_back = Trainer(args.trainer_dir), {}, []
    try:
        async with ckpt.worker(controller):
            if await rollouts.awaiting_restore():  # a restart: the run has snapshots
                held = trainer.versions()
                plan = await ckpt.restore(f"restart-{uuid.uuid4().hex[:8]}", weight_versions=held)
                rolled_back = trainer.load(plan.weight_version)
                print(
                    f"[restore] {plan.snapshot}: weight version {plan.weight_version}, ready "
                    f"{plan.ready}, to generate {plan.redispatch}",
                    flush=True,
                )
            else:
                trainer.save(0)
            await ckpt.start()
            for version in rolled_back:
                await ckpt.trainer_checkpoint_removed(version)
            while (version := await rollouts.weight_version()) < args.steps:
                if (owned := await rollouts.owned()) < 2 * per_step:  # one step ahead
                    await rollouts.handout_next(2 * per_step - owned)
                for owed in await rollouts.owed():
                    key = (owed.group, owed.sibling)
                    if key not in running:
                        running[key] = asyncio.create_task(episode(rollouts, *key, args))
                if stale := await rollouts.stale():  # windowed sampler: past the window
                    await rollouts.evict(stale)
                if not (groups := await rollouts.select()):
                    for key in [key for key, task in running.items() if task.done()]:
                        running.pop(key).result()  # an episode's failure ends the run here
                    if running:
                        await asyncio.wait(running.values(), return_when=asyncio.FIRST_COMPLETED)
                    continue
                await rollouts.claim(groups, version)
                trainer.history += train(version, await rollouts.rows(groups))
                path = trainer.save(version + 1)
                await rollouts.commit_step(groups)
                await ckpt.train_step_committed(version)
                # Its anchored snapshot, awaited: sure of one at every trainer checkpoint.
                outcome = await ckpt.trainer_checkpoint_saved(version + 1, path, wait=True)
                assert outcome is not None
                print(
                    f"[step {version}] trained {groups}; snapshot {outcome.status} at weight "
                    f"version {version + 1}",
                    flush=True,
                )
            await ckpt.stop(wait=True)  # the worker in this process lets the supervisor end
            print(f"[done] {args.steps} steps, {len(trainer.history)} groups trained", flush=True)
    finally:
        for task in running.values():
            task.cancel()
        assert controller.participants is not None
        controller.participants.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps to train")
    parser.add_argument("--turns", type=int, default=2, help="tool calls per episode")
    parser.add_argument("--trainer-dir", type=Path, required=True, help="trainer checkpoints")
    parser.add_argument("-v", "--verbose", action="store_true", help="a line per episode")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
