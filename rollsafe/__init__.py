"""rollsafe: durable, lossless checkpoint and restore of an async RL run's rollout state.

The names below are the public API; everything else is private by convention and may change.
They are loaded on first use (PEP 562), so ``import rollsafe`` costs nothing: no Temporal
client, Ray, HTTP library or torch is imported until a name that needs one is touched.

- settings: :class:`Settings`, everything a user sets, from one YAML section, environment
  variables or a mapping; the models it builds: :class:`RunConfig`, :class:`ConnectionSettings`
  (Temporal), :class:`PhaseOptions` and :class:`SupervisorConfig` (the checkpoint workflows);
- the trainer SDK: :class:`Checkpointer` and :class:`SyncCheckpointer` (its status
  :class:`CheckpointerStatus`), and what a restore hands back, :class:`RestorePlan`;
- the rollout source, what a trainer's loop pulls its batches from: :class:`RolloutSource`
  and :class:`SyncRolloutSource`, and what it hands out, :class:`Batch`;
- the run side, for a framework's own rollout loop: :class:`Rollouts` and
  :class:`SyncRollouts` over the run's :class:`Controller` (:func:`start_controller_actor`),
  what it owes, :class:`OwedRollout`, and a rollout's training row, :class:`Row` (named
  numpy arrays);
- the engine protocol: :class:`Engine`, :class:`GenerateRequest`, :class:`SamplingParams`,
  :class:`Completion`, :class:`PrefixRecord`;
- the environment protocol: :class:`EnvironmentHooks`, :class:`EpisodeSession`, and what an
  episode returns, :class:`EpisodeResult`;
- telemetry: :func:`configure_telemetry`, for a program of your own that wants rollsafe's
  meter and tracer providers (the ``rollsafe`` commands and workers install them already; a
  library object never does);
- errors: the tree's roots (:class:`RollsafeError`, :class:`TransientError`,
  :class:`InvariantError`, :class:`InvalidInput`) and the module ``errors``, the whole tree.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

# name -> the module that defines it
_WHERE = {
    "Checkpointer": "rollsafe.client",
    "CheckpointerStatus": "rollsafe.client",
    "SyncCheckpointer": "rollsafe.client",
    "Settings": "rollsafe.settings",
    "RolloutSource": "rollsafe.source",
    "SyncRolloutSource": "rollsafe.source",
    "Batch": "rollsafe.source",
    "Rollouts": "rollsafe.rollouts",
    "SyncRollouts": "rollsafe.rollouts",
    "OwedRollout": "rollsafe.checkpoint.controller",
    "Row": "rollsafe.dataplane",
    "RunConfig": "rollsafe.core.config",
    "ConnectionSettings": "rollsafe.temporal.connect",
    "PhaseOptions": "rollsafe.workflows.models",
    "SupervisorConfig": "rollsafe.workflows.models",
    "Controller": "rollsafe.checkpoint.controller",
    "start_controller_actor": "rollsafe.checkpoint.actor",
    "RestorePlan": "rollsafe.core.phases",
    "Engine": "rollsafe.engine.protocol",
    "GenerateRequest": "rollsafe.engine.protocol",
    "SamplingParams": "rollsafe.engine.protocol",
    "Completion": "rollsafe.engine.protocol",
    "PrefixRecord": "rollsafe.engine.protocol",
    "EnvironmentHooks": "rollsafe.env.hooks",
    "EpisodeSession": "rollsafe.env.hooks",
    "EpisodeResult": "rollsafe.env.protocol",
    "RollsafeError": "rollsafe.errors",
    "TransientError": "rollsafe.errors",
    "InvariantError": "rollsafe.errors",
    "InvalidInput": "rollsafe.errors",
    "configure_telemetry": "rollsafe.observability.telemetry",
}

__all__ = [
    "Batch",
    "Checkpointer",
    "CheckpointerStatus",
    "Completion",
    "ConnectionSettings",
    "Controller",
    "Engine",
    "EnvironmentHooks",
    "EpisodeResult",
    "EpisodeSession",
    "GenerateRequest",
    "InvalidInput",
    "InvariantError",
    "OwedRollout",
    "PhaseOptions",
    "PrefixRecord",
    "RestorePlan",
    "RolloutSource",
    "Rollouts",
    "RollsafeError",
    "Row",
    "RunConfig",
    "SamplingParams",
    "Settings",
    "SupervisorConfig",
    "SyncCheckpointer",
    "SyncRolloutSource",
    "SyncRollouts",
    "TransientError",
    "__version__",
    "configure_telemetry",
    "errors",
    "start_controller_actor",
]

if TYPE_CHECKING:
    from rollsafe import errors
    from rollsafe.checkpoint.actor import start_controller_actor
    from rollsafe.checkpoint.controller import Controller, OwedRollout
    from rollsafe.client import Checkpointer, CheckpointerStatus, SyncCheckpointer
    from rollsafe.core.config import RunConfig
    from rollsafe.core.phases import RestorePlan
    from rollsafe.dataplane import Row
    from rollsafe.engine.protocol import (
        Completion,
        Engine,
        GenerateRequest,
        PrefixRecord,
        SamplingParams,
    )
    from rollsafe.env.hooks import EnvironmentHooks, EpisodeSession
    from rollsafe.env.protocol import EpisodeResult
    from rollsafe.errors import InvalidInput, InvariantError, RollsafeError, TransientError
    from rollsafe.observability.telemetry import configure_telemetry
    from rollsafe.rollouts import Rollouts, SyncRollouts
    from rollsafe.settings import Settings
    from rollsafe.source import Batch, RolloutSource, SyncRolloutSource
    from rollsafe.temporal.connect import ConnectionSettings
    from rollsafe.workflows.models import PhaseOptions, SupervisorConfig


def __getattr__(name: str) -> Any:
    if name == "errors":
        return importlib.import_module("rollsafe.errors")
    if name not in _WHERE:
        raise AttributeError(f"module 'rollsafe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
