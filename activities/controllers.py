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
from rollsafe.errors import ControllerUnavailable, RollsafeError, VersionSkew
from rollsafe.versions import THIS, Peer, check_peer, unversioned_peer


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
    found again, and a missing one is a transient error the activity retries. Each actor is
    asked who it is before the first call (rollsafe.versions): one too many releases apart is
    VersionSkew, not retried; an actor of a release before contracts has nothing to ask, and a
    call it cannot take (Ray's TypeError, raised here) is VersionSkew too."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._checked: set[str] = set()  # actor ids whose contract is known to work

    def _what(self) -> str:
        return f"the controller actor of run {self.run_id!r}"

    async def _check_contract(self, actor: Any) -> None:
        actor_id = actor._actor_id.hex()
        if actor_id in self._checked:
            return
        said = await actor.__ray_call__.remote(CONTRACT_PROBE)
        peer = unversioned_peer() if said is None else Peer.model_validate(said)
        check_peer(self._what(), peer)
        self._checked.add(actor_id)

    async def _call(self, method: str, *args: object) -> Any:
        import ray

        from rollsafe.checkpoint.actor import get_controller_actor

        try:
            actor = get_controller_actor(self.run_id)
            await self._check_contract(actor)
            try:
                call = getattr(actor, method).remote(*args)
            except (TypeError, AttributeError) as exc:  # its methods differ from ours
                raise VersionSkew(
                    f"{self._what()} cannot take {method}: {type(exc).__name__}: {exc}: it is "
                    f"of a release this worker (rollsafe {THIS.release}, contract "
                    f"{THIS.contract}) does not work with (docs/upgrading.md)"
                ) from None
            return await call
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


def _contract_probe() -> Callable[[object], dict[str, object] | None]:
    def contract_in_actor(_controller: object) -> dict[str, object] | None:
        try:
            from rollsafe.versions import THIS
        except ImportError:
            return None
        return THIS.model_dump(mode="json")

    return contract_in_actor


# Run inside the actor (``__ray_call__``): its release's contract, None for a release before
# contracts. Made in a function so that Ray ships its code, not its name: the actor's release
# may not have this module's. Not a controller method either: a driver loads an actor's class
# by its methods' names, and one of a release without the method cannot (rollsafe.versions).
CONTRACT_PROBE = _contract_probe()
