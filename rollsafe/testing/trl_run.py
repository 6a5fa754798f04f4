"""One TRL GRPOTrainer run, as a user would start it, for the tests and the bench (run as
``python -m rollsafe.testing.trl_run``): a tiny model built here, prompts that are a pure
function of their index, a reward that is a pure function of the completion, one engine, fixed
seeds. Two modes, the same trainer, the same engine:

- ``rollsafe``: rollouts from :class:`rollsafe.integrations.trl.LosslessRollouts` (settings from
  ``ROLLSAFE_*``), its evidence in ``OUT/evidence``;
- ``plain``: TRL alone, a stateless ``rollout_func`` calling the engine directly (what a TRL user
  wires to an external engine today) and a callback sending each step's weights to it; each
  completion's start and end are lines of ``OUT/plain_generations.jsonl`` (the evidence's
  ``generations.jsonl`` format: ``rollsafe.evidence.verify.account_generations`` reads both).
  ``--keep-engine-weights``: it sends none, for a run beside another trainer on the same engine
  (two trainers sending weights to one engine race on its weight version: the engine refuses
  the one that is not newer).

It prints one line per event, flushed, for a test to wait on (never a timing): ``[step N]``
when optimizer step N committed (and the wall clock then), ``[saved N]`` once checkpoint-N is
saved (and, with rollsafe, its anchored snapshot published), ``[done N]``. ``--resume``
resumes from the newest checkpoint in ``OUT/trl``, as TRL's ``resume_from_checkpoint=True``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rollsafe.evidence.files import GenerationEvent, append_lines

if TYPE_CHECKING:
    from rollsafe.reference.rl.controller import Endpoints
    from rollsafe.temporal.connect import ConnectionSettings

PROMPTS = 64
GROUP_SIZE, GROUPS_PER_STEP, MAX_TOKENS = 2, 2, 8
PLAIN_GENERATIONS = "plain_generations.jsonl"
ENGINE_URL_ENV = "ROLLSAFE_TRL_ENGINE_URL"  # TRL alone's engine


def reward_low_tokens(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The share of a completion's tokens below 256: a pure function of the completion."""
    return [sum(t < 256 for t in ids) / max(1, len(ids)) for ids in completion_ids]


class PlainRollouts:
    """TRL alone: each step's completions from the engine, nothing kept between calls; with
    the callback's weights sent after every step (:meth:`on_step_end`)."""

    def __init__(self, engine_url: str, token: str, out: Path, args: argparse.Namespace) -> None:
        from rollsafe.engine.http import EngineClient
        from rollsafe.loop_thread import LoopThread

        self.size, self.per_step = args.num_generations, args.groups_per_step
        self.max_tokens = args.max_tokens
        self.loop = LoopThread("plain-trl")
        self.engine = self.loop.run(_client(EngineClient, engine_url, token))
        self.log = out / PLAIN_GENERATIONS
        self.run = uuid.uuid4().hex[:8]
        self.version: int | None = None  # the engine's weight version, once asked

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        from rollsafe.integrations.trl import prompt_ids

        ids = [prompt_ids(trainer.processing_class, p, {}) for p in prompts]
        made = self.loop.run(
            self._complete_all(trainer.state.global_step, ids, trainer.eos_token_ids)
        )
        return {
            "prompt_ids": ids,
            "completion_ids": [list(c.tokens) for c in made],
            "logprobs": [list(c.logprobs) for c in made],
        }

    async def _complete_all(self, step: int, prompts: list[list[int]], stop: list[int]) -> Any:
        from rollsafe.engine.protocol import GenerateRequest, SamplingParams, completion_of

        async def one(j: int, prompt: list[int]) -> Any:
            group, sibling = step * self.per_step + j // self.size, j % self.size
            sampling = SamplingParams(
                seed=group * self.size + sibling, max_tokens=self.max_tokens, stop_token_ids=stop
            )
            call = f"plain-{self.run}-{group}_g{sibling}-{uuid.uuid4().hex[:6]}"
            request = GenerateRequest(call_id=call, prompt_tokens=prompt, sampling=sampling)
            rollout = f"plain-{group}_g{sibling}"  # the same prompt's, in every process
            self._record("started", rollout)
            done = completion_of(call, [e async for e in self.engine.generate(request)])
            self._record("sealed", rollout)
            return done

        return await asyncio.gather(*(one(j, p) for j, p in enumerate(prompts)))

    def _record(self, event: Literal["started", "sealed"], rollout: str) -> None:
        line = GenerationEvent(event=event, rollout_id=rollout, attempt=0, at_unix=time.time())
        append_lines(self.log, [line])

    def send_weights(self, weights: Any) -> None:
        async def send() -> None:
            if self.version is None:  # asked once, as the rollout source does
                self.version = (await self.engine.info()).weight_version
            self.version += 1
            await self.engine.update_weights(weights, self.version)

        self.loop.run(send())


def user_env(
    connection: ConnectionSettings, endpoints: Endpoints, root: Path, run_id: str
) -> dict[str, str]:
    """What a user of either mode exports: rollsafe's settings (the snapshot root under
    ``root``), Temporal's, the servers' tokens, and TRL alone's engine."""
    return {
        **os.environ,
        "ROLLSAFE_RUN_ID": run_id,
        "ROLLSAFE_SNAPSHOT_ROOT": str(root / "snapshots"),
        "ROLLSAFE_PARTICIPANTS__ENVS": json.dumps(endpoints.envs),
        "ROLLSAFE_PARTICIPANTS__ENGINES": json.dumps({"vllm": endpoints.engine_url}),
        "ROLLSAFE_ENV_TOKEN": endpoints.env_token,
        "ROLLSAFE_ENGINE_TOKEN": endpoints.engine_token,
        ENGINE_URL_ENV: endpoints.engine_url,
        "TEMPORAL_ADDRESS": connection.address,
        "TEMPORAL_NAMESPACE": connection.namespace,
    }


async def _client(cls: Any, url: str, token: str) -> Any:
    return cls(url, token)  # made on the loop that will use it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("rollsafe", "plain"), required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=GROUP_SIZE)
    parser.add_argument("--groups-per-step", type=int, default=GROUPS_PER_STEP)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--ahead-steps", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--keep-engine-weights", action="store_true")  # plain: sends none
    args = parser.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    from rollsafe.integrations.trl import LosslessRollouts

    args.out.mkdir(parents=True, exist_ok=True)
    config = GRPOConfig(
        output_dir=str(args.out / "trl"),
        max_steps=args.max_steps,
        save_steps=args.save_steps,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations * args.groups_per_step,
        gradient_accumulation_steps=1,
        max_completion_length=args.max_tokens,
        learning_rate=1e-3,
        shuffle_dataset=False,
        use_cpu=True,
        bf16=False,
        seed=0,
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
    )
    dataset = Dataset.from_dict({"prompt": [f"prompt number {i}" for i in range(PROMPTS)]})
    plain = None
    if args.mode == "rollsafe":
        evidence = args.out / "evidence"
        rollouts: Any = LosslessRollouts(evidence=evidence, ahead_steps=args.ahead_steps)
        callbacks: list[Any] = [rollouts]
    else:
        url, token = os.environ[ENGINE_URL_ENV], os.environ["ROLLSAFE_ENGINE_TOKEN"]
        plain = PlainRollouts(url, token, args.out, args)
        rollouts, callbacks = plain, []

    class Events(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, a: Any, state: Any, c: Any, model: Any = None, **_: Any) -> None:
            if plain is not None and not args.keep_engine_weights:
                plain.send_weights(model.state_dict())
            print(f"[step {state.global_step}] {time.time():.3f}", flush=True)

        def on_save(self, a: Any, state: Any, c: Any, **_: Any) -> None:
            print(f"[saved {state.global_step}]", flush=True)

    trainer = GRPOTrainer(
        model=str(args.model),
        reward_funcs=[reward_low_tokens],
        args=config,
        train_dataset=dataset,
        rollout_func=rollouts,
        callbacks=[*callbacks, Events()],
    )
    if plain is not None and not args.keep_engine_weights:  # its starting weights
        plain.send_weights(trainer.model.state_dict())
    started = time.time()
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    print(f"[done {trainer.state.global_step}] {time.time() - started:.2f}s", flush=True)
    os._exit(0)  # Temporal's client may abort at interpreter exit (docs/integrating.md)


if __name__ == "__main__":
    main()
