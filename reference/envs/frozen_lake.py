"""gymnasium's FrozenLake as a checkpointable environment: docs/environment-protocol.md's example.

A task is ``{"map": "4x4" | "8x8", "turns": n}``: n moves on the slippery lake, each picked by
the policy engine; a hole or the goal starts the walk again; the reward is the goals reached.
Serve it:
``rollsafe env serve --hooks rollsafe.reference.envs.frozen_lake:FrozenLake --engine-url ...``
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import gymnasium as gym
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollsafe.env.hooks import EnvironmentHooks, EpisodeSession
from rollsafe.env.protocol import EpisodeRef, EpisodeResult, RunEpisode
from rollsafe.env.serve import ServeContext
from rollsafe.errors import InvalidInput


class Task(BaseModel):
    model_config = ConfigDict(extra="forbid")
    map: Literal["4x4", "8x8"] = "4x4"
    turns: int = Field(default=8, ge=1, le=64)


class Walk(Task):
    """An episode's whole state at a boundary: what export_episode writes, restore reads."""

    turn: int = Field(default=0, ge=0)
    cell: int = Field(default=0, ge=0, lt=64)
    goals: int = Field(default=0, ge=0)


def slip_seed(rollout_id: str, turn: int) -> int:
    """The lake's slip at a turn: keyed by rollout and turn, like the policy's sampling, so a
    restored attempt slips as the first one did (never a generator's running state)."""
    return int.from_bytes(hashlib.sha256(f"{rollout_id}:{turn}".encode()).digest()[:8], "big")


def parsed(model: type[Walk] | type[Task], raw: dict[str, Any]) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:  # raised as InvalidInput: a 422 (task) or a refused record
        raise InvalidInput(f"bad frozen_lake {model.__name__}: {exc.errors()[0]['msg']}") from None


class FrozenLake(EnvironmentHooks):
    name = "frozen_lake"
    side_effects = False  # a game: nothing outside the walk changes

    def __init__(self, context: ServeContext) -> None:
        if context.engine is None:
            raise InvalidInput("frozen_lake needs --engine-url: the policy picks every move")
        self.engine = context.engine
        self.live: dict[str, Walk] = {}  # episode key -> its state at its last boundary

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        task: Task = parsed(Task, run.task)
        restored = session.restored  # a restored attempt continues its record
        walk: Walk = parsed(Walk, restored) if restored else Walk(**task.model_dump())
        lake: Any = gym.make("FrozenLake-v1", map_name=walk.map).unwrapped
        key, rollout = session.episode.key, session.episode.rollout_id
        try:
            while True:
                self.live[key] = walk
                await session.boundary(walk.turn)  # parks here while a checkpoint is open
                if walk.turn == walk.turns:
                    break
                request = session.request(walk.turn, [1 + walk.cell, 100 + walk.turn], max_tokens=4)
                completion = await session.complete(self.engine, request)  # cut and resumed
                with session.tool():  # the move: applied once, never parked half-way
                    lake.reset()
                    lake.s = walk.cell
                    lake.np_random = np.random.default_rng(slip_seed(rollout, walk.turn))
                    cell, reward, ended, _, _ = lake.step(completion.tokens[-1] % 4)
                    walk = walk.model_copy(
                        update={
                            "turn": walk.turn + 1,
                            "cell": 0 if ended else int(cell),
                            "goals": walk.goals + int(float(reward)),
                        }
                    )
        finally:
            self.live.pop(key, None)
        return EpisodeResult(
            episode=session.episode, reward=walk.goals, turns=walk.turn, restored=False
        )

    def export_episode(self, episode: EpisodeRef) -> dict[str, Any]:
        if episode.key not in self.live:
            raise InvalidInput(f"frozen_lake holds no live episode {episode.key}")
        return self.live[episode.key].model_dump()

    def restore_episode(self, episode: EpisodeRef, record: dict[str, Any]) -> None:
        parsed(Walk, record)  # a record that is not a walk refuses the restore

    def state_digest(self, episode: EpisodeRef) -> str | None:
        walk = self.live[episode.key]  # the whole state: the lake is reset from it every turn
        return hashlib.sha256(walk.model_dump_json().encode()).hexdigest()

    def drop_episode(self, episode: EpisodeRef) -> None:
        self.live.pop(episode.key, None)
