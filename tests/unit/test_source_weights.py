"""The rollout source's weights to the run's engines (RolloutSource.set_weights, step_done's
``weights``), on the reference engine in process: an engine that already served the version
(the lineage a restore rolled back, or the base model at 0) gets the weights under a higher one,
every later push keeps the offset (an engine refuses a version it has passed), and a run without
an engine is told so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollsafe.checkpoint.controller import Controller
from rollsafe.checkpoint.participants import Participants
from rollsafe.core.ids import EpisodeId
from rollsafe.dataplane import Row
from rollsafe.engine.model import ModelConfig
from rollsafe.engine.torch_engine import TorchEngine
from rollsafe.env.client import EnvClient
from rollsafe.env.fleet import EnvFleet
from rollsafe.errors import InvalidInput
from rollsafe.loop_thread import LoopThread
from rollsafe.settings import Settings
from rollsafe.source import RolloutSource


def source_on(engine: TorchEngine | None, root: Path) -> RolloutSource:
    """A source whose controller's participants are ``engine`` alone (not entered: no
    Temporal; weights need none)."""
    loop = LoopThread("weights-test")
    fleet = loop.run(_fleet())
    engines = {"e": engine} if engine is not None else {}
    participants = Participants(fleet, engines, loop=loop)
    settings = Settings.load(
        {"run_id": "w", "run": {"group_size": 1, "groups_per_step": 1}}, env={}
    )
    source = RolloutSource(settings, generate=never)
    source.controller = Controller(settings.run_config(), root, participants=participants)
    return source


async def never(episode: EpisodeId) -> Row:
    raise AssertionError(f"{episode} was generated: nothing here dispatches")


async def _fleet() -> EnvFleet:
    return EnvFleet({"env-0": EnvClient("http://127.0.0.1:9", "unused")})  # never dialled


async def test_a_restarted_trainers_weights_go_above_what_the_engine_served(
    tmp_path: Path,
) -> None:
    async with TorchEngine(ModelConfig(), seed=0, weight_version=3) as engine:
        source = source_on(engine, tmp_path)
        weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
        try:
            source._version = 1  # restored at weight version 1; the engine served 3
            await source.set_weights(weights)
            assert (await engine.info()).weight_version == 4
            await source._send_weights(weights, 2)  # the next step's: the same offset
            assert (await engine.info()).weight_version == 5
        finally:
            assert source.controller.participants is not None
            source.controller.participants.close()


async def test_weights_without_an_engine_are_refused_by_name(tmp_path: Path) -> None:
    source = source_on(None, tmp_path)
    try:
        with pytest.raises(InvalidInput, match="names no engine to send weights to"):
            await source.set_weights({"w": torch.zeros(1)})
    finally:
        assert source.controller.participants is not None
        source.controller.participants.close()
