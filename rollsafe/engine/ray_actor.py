"""The reference engine as a Ray actor, and the actor seen through the engine protocol.

``EngineActor.remote(config, seed)`` runs a :class:`TorchEngine` in its own worker process (an
async actor: many calls at once; ``generate``/``resume`` stream through Ray's generator
support). :class:`RayEngine` wraps the handle so callers written against
:class:`~rollsafe.engine.protocol.Engine` do not know where the engine lives.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import ray

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
