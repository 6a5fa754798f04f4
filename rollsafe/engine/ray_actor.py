"""An engine as a Ray actor, and the actor seen through the engine protocol.

``EngineActor.remote(config, seed)`` runs a :class:`TorchEngine` in its own worker process,
``vllm_engine_actor().remote(model_dir, dtype=...)`` a
:class:`~rollsafe.engine.vllm.engine.VllmEngine` (async actors: many calls at once;
``generate``/``resume`` stream through Ray's generator support). :class:`RayEngine` wraps
either handle so callers written against :class:`~rollsafe.engine.protocol.Engine` know
neither where the engine lives nor which it is. Weights travel as Ray objects (torch tensors
of any float dtype, bf16 included).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import ray
import torch

from rollsafe.engine.protocol import (
    CUT_BATCH,
    CutReport,
    EngineInfo,
    GenerateRequest,
    PrefixRecord,
    StreamEvent,
)
from rollsafe.engine.torch_engine import TorchEngine

EngineActor = ray.remote(TorchEngine)


def vllm_engine_actor() -> Any:
    """The :class:`~rollsafe.engine.vllm.engine.VllmEngine` actor class (one engine per actor
    process, as vLLM allows one per process). A function: importing this module must not
    need vLLM."""
    from rollsafe.engine.vllm.engine import VllmEngine

    return ray.remote(VllmEngine)


class RayEngine:
    """An :class:`~rollsafe.engine.protocol.Engine` backed by an :data:`EngineActor` handle."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        async for ref in self.handle.generate.remote(request):
            yield await ref

    async def resume(
        self, request: GenerateRequest, prefix: PrefixRecord
    ) -> AsyncIterator[StreamEvent]:
        async for ref in self.handle.resume.remote(request, prefix):
            yield await ref

    async def cut(self, call_ids: Sequence[str], *, batch_size: int = CUT_BATCH) -> CutReport:
        report: CutReport = await self.handle.cut.remote(list(call_ids), batch_size=batch_size)
        return report

    async def release(self, call_ids: Sequence[str]) -> int:
        released: int = await self.handle.release.remote(list(call_ids))
        return released

    async def info(self) -> EngineInfo:
        info: EngineInfo = await self.handle.info.remote()
        return info

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        await self.handle.update_weights.remote(dict(weights), version)

    async def close(self) -> None:
        await self.handle.close.remote()
