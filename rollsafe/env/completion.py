"""The completion environment: an episode is one model call, the prompt's tokens in, the
completion's tokens and logprobs out (``rollsafe env serve completion --engine-url ...``).

A trainer whose rollouts are single completions of its prompts (TRL's GRPOTrainer, the
example loop) runs each as an episode here, so a snapshot parks it, cuts its call, and a
restore resumes the call from the cut's prefix on any engine of the same model, as for any
multi-turn environment. The trainer scores the completion itself: the episode's reward is 0.

A task::

    {"prompt": [token ids], "max_tokens": 64, "temperature": 1.0, "top_p": 1.0, "stop": [eos ids]}

The result's ``info``: ``prompt``, ``tokens`` and ``logprobs`` (the completion, a resumed
prefix included) and ``finish_reason``; ``info["attempt"]["resumed_tokens"]``: how many of the
tokens this attempt took from a cut's prefix instead of generating them.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from rollsafe.engine.protocol import Completion, Engine, FinishReason, GenerateRequest
from rollsafe.env.hooks import EnvironmentHooks, EpisodeSession
from rollsafe.env.protocol import EpisodeRef, EpisodeResult, RunEpisode
from rollsafe.env.serve import ServeContext
from rollsafe.errors import InvalidInput

FORMAT: Literal["completion/1"] = "completion/1"
Token = Annotated[StrictInt, Field(ge=0)]


class CompletionTask(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: tuple[Token, ...] = Field(min_length=1)
    max_tokens: StrictInt = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: tuple[Token, ...] = ()


class Completed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: tuple[Token, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason


class CompletionRecord(BaseModel):
    """An episode's whole state at a boundary (what ``export_episode`` writes): its task, and
    its completion once the call returned. ``in_flight``: parked while the call generated (a
    restored attempt re-issues it at once, and it resumes from the cut's prefix)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["completion/1"] = FORMAT
    task: CompletionTask
    in_flight: bool = False
    completion: Completed | None = None


def parsed(model: type[CompletionTask] | type[CompletionRecord], raw: dict[str, Any]) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:  # InvalidInput: a 422 for a task, a refused restore
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        raise InvalidInput(f"bad completion {model.__name__}: {where}: {problem['msg']}") from None


class CompletionEnv(EnvironmentHooks):
    name = "completion"
    side_effects = False  # one model call: nothing outside the episode changes

    def __init__(self, context: ServeContext) -> None:
        if context.engine is None:
            raise InvalidInput("the completion environment needs --engine-url: it calls the policy")
        self.engine: Engine = context.engine
        self.live: dict[str, CompletionRecord] = {}  # episode key -> its state at its boundary

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        task: CompletionTask = parsed(CompletionTask, run.task)
        record = parsed(CompletionRecord, session.restored) if session.restored else None
        if record is not None and record.task != task:
            raise InvalidInput(f"the record of {session.episode.key} is another task's")
        record = record or CompletionRecord(task=task)
        key, resumed = session.episode.key, 0
        try:
            if record.completion is None:
                if not record.in_flight:
                    self.live[key] = record
                    await session.boundary(0)  # parks here while a checkpoint is open
                self.live[key] = record.model_copy(update={"in_flight": True})
                completion = await session.complete(self.engine, self._request(session, task))
                resumed = session.resumed_tokens(completion)
                record = record.model_copy(update={"completion": _completed(completion)})
                self.live[key] = record
                await session.boundary(1)
        finally:
            self.live.pop(key, None)
        assert record.completion is not None
        return EpisodeResult(
            episode=session.episode,
            reward=0.0,  # the trainer scores the completion
            turns=1,
            restored=False,  # the toolkit says whether it was
            info={
                "prompt": list(task.prompt),
                "tokens": list(record.completion.tokens),
                "logprobs": list(record.completion.logprobs),
                "finish_reason": record.completion.finish_reason,
                "attempt": {"resumed_tokens": resumed},  # this attempt's, not the episode's
            },
        )

    def export_episode(self, episode: EpisodeRef) -> dict[str, Any]:
        if episode.key not in self.live:
            raise InvalidInput(f"the completion environment holds no live episode {episode.key}")
        return self.live[episode.key].model_dump(mode="json")

    def restore_episode(self, episode: EpisodeRef, record: dict[str, Any]) -> None:
        parsed(CompletionRecord, record)  # a record that is not one refuses the restore

    def state_digest(self, episode: EpisodeRef) -> str | None:
        record = self.live[episode.key]  # the whole state: the engine holds the rest
        return hashlib.sha256(record.model_dump_json().encode()).hexdigest()

    def drop_episode(self, episode: EpisodeRef) -> None:
        self.live.pop(episode.key, None)

    @staticmethod
    def _request(session: EpisodeSession, task: CompletionTask) -> GenerateRequest:
        return session.request(
            0,
            task.prompt,
            max_tokens=task.max_tokens,
            temperature=task.temperature,
            top_p=task.top_p,
            stop_token_ids=task.stop,
        )


def completion_row(result: EpisodeResult) -> dict[str, np.ndarray]:
    """An episode's training row: its ``prompt``, the completion's ``tokens`` and ``logprobs``,
    and ``restored_prefix_tokens`` (this attempt's tokens taken from a cut's prefix)."""
    info = result.info
    return {
        "prompt": np.asarray(info["prompt"], np.int64),
        "tokens": np.asarray(info["tokens"], np.int64),
        "logprobs": np.asarray(info["logprobs"], np.float32),
        "restored_prefix_tokens": np.asarray(info["attempt"]["resumed_tokens"], np.int64),
    }


def _completed(completion: Completion) -> Completed:
    return Completed(
        tokens=completion.tokens,
        logprobs=completion.logprobs,
        finish_reason=completion.finish_reason,
    )
