"""How activities reach a run's controller: the Ray actor (a cluster), or the same
:class:`Controller` in this process (the embedded default and unit tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from rollsafe.checkpoint.controller import Controller
from rollsafe.core.phases import (
    PhaseRequest,
    PhaseResult,
    RestorePlan,
    RestoreRequest,
    SnapshotSpec,
)
from rollsafe.errors import ControllerUnavailable, RollsafeError


class ControllerClient(Protocol):
    async def run_phase(self, request: PhaseRequest) -> PhaseResult: ...

    async def renew_admission(self, spec: SnapshotSpec) -> bool: ...

    async def abort(self, spec: SnapshotSpec) -> PhaseResult: ...

    async def next_seq(self) -> int: ...

    async def restore(self, request: RestoreRequest) -> RestorePlan: ...


ControllerResolver = Callable[[str], ControllerClient]  # run id -> its controller


class LocalControllerClient:
    """Calls the operations in a thread, so the worker's event loop keeps heartbeating."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    async def run_phase(self, request: PhaseRequest) -> PhaseResult:
        return await asyncio.to_thread(self.controller.run_phase, request)

    async def renew_admission(self, spec: SnapshotSpec) -> bool:
        return await asyncio.to_thread(self.controller.renew_admission, spec)

    async def abort(self, spec: SnapshotSpec) -> PhaseResult:
        return await asyncio.to_thread(self.controller.abort, spec)

    async def next_seq(self) -> int:
        return await asyncio.to_thread(self.controller.next_seq)

    async def restore(self, request: RestoreRequest) -> RestorePlan:
        return await asyncio.to_thread(self.controller.restore, request)


class RayControllerClient:
    """The run's named controller actor, looked up on every call: a restarted actor is
    found again, and a missing one is a transient error the activity retries."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    async def _call(self, method: str, *args: object) -> Any:
        import ray

        from rollsafe.checkpoint.actor import get_controller_actor

        try:
            actor = get_controller_actor(self.run_id)
            return await getattr(actor, method).remote(*args)
        except ray.exceptions.RayTaskError as exc:
            # The controller raised: its own error, with its own class (transient or not),
            # not Ray's wrapper around it.
            if isinstance(exc.cause, RollsafeError):
                raise exc.cause from None
            raise
        except (ray.exceptions.RayActorError, ValueError) as exc:
            raise ControllerUnavailable(
                f"controller actor of run {self.run_id!r} unavailable: {exc}"
            ) from exc

    async def run_phase(self, request: PhaseRequest) -> PhaseResult:
        result: PhaseResult = await self._call("run_phase", request)
        return result

    async def renew_admission(self, spec: SnapshotSpec) -> bool:
        renewed: bool = await self._call("renew_admission", spec)
        return renewed

    async def abort(self, spec: SnapshotSpec) -> PhaseResult:
        result: PhaseResult = await self._call("abort", spec)
        return result

    async def next_seq(self) -> int:
        seq: int = await self._call("next_seq")
        return seq

    async def restore(self, request: RestoreRequest) -> RestorePlan:
        plan: RestorePlan = await self._call("restore", request)
        return plan
