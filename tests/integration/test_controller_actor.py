"""The controller as a named Ray actor: the ten phases through it, idempotent across handles,
typed errors across the process boundary, a fault point that kills the actor's process."""

import sys
from pathlib import Path
from typing import Any

import pytest

from rollsafe.activities.controllers import RayControllerClient
from rollsafe.checkpoint.actor import (
    NAMESPACE,
    actor_name,
    get_controller_actor,
    start_controller_actor,
)
from rollsafe.core.config import RunConfig
from rollsafe.core.phases import PHASES, Phase, PhaseRequest, PhaseResult, SnapshotSpec
from rollsafe.dataplane import make_dataplane
from rollsafe.errors import CheckpointBusy, ControllerUnavailable, SnapshotLost, VersionSkew
from rollsafe.evidence.scenario import row_content
from rollsafe.faults import ENV_VAR
from rollsafe.snapshot import SnapshotStore, state_files
from rollsafe.versions import CONTRACT


def config(run_id: str) -> RunConfig:
    return RunConfig(run_id=run_id, group_size=2, groups_per_step=2)


def phases(handle: Any, spec: SnapshotSpec, ray: Any) -> list[PhaseResult]:
    return [ray.get(handle.run_phase.remote(PhaseRequest(spec=spec, phase=p))) for p in PHASES]


def test_ten_phases_through_the_named_actor(ray_session: Any, tmp_path: Path) -> None:
    ray = ray_session
    run_id = "ray-a"
    first = start_controller_actor(run_id, config(run_id), tmp_path)
    try:
        ray.get(first.handout.remote([0, 1, 2]))
        for idx, i in [(0, 0), (0, 1), (1, 0)]:
            episode = ray.get(first.dispatch.remote(idx, i))
            ray.get(first.seal.remote(idx, i, episode.attempt, row_content(idx, i, 0)))
        spec = SnapshotSpec(run_id=run_id, seq=1)
        results = phases(first, spec, ray)
        assert not any(r.replayed for r in results)
        info = results[-1].published
        assert info is not None and info.counts["sealed_rollouts"] == 3

        # Another process (a retried activity) finds the same actor by name.
        second = get_controller_actor(run_id)
        assert second._actor_id == first._actor_id
        again = phases(second, spec, ray)
        assert all(r.replayed for r in again) and again[-1].published == info
        same = start_controller_actor(run_id, config(run_id), tmp_path)  # get-if-exists
        status = ray.get(same.status.remote())
        assert status.gate_open and status.open_checkpoint is None
        assert status.effects["open"] == status.effects["capture"] == 1
        assert status.effects["publish"] == 1

        # Errors cross the process boundary with their type (the activity layer maps them).
        open_request = PhaseRequest(spec=SnapshotSpec(run_id=run_id, seq=2), phase=Phase.OPEN)
        ray.get(first.run_phase.remote(open_request))
        refused = PhaseRequest(spec=SnapshotSpec(run_id=run_id, seq=3), phase=Phase.OPEN)
        with pytest.raises(CheckpointBusy, match=r"00000003 cannot open.*00000002"):
            ray.get(second.run_phase.remote(refused))
    finally:
        ray.kill(first)

    _, plan = state_files.restore(
        config(run_id), SnapshotStore(tmp_path, run_id), make_dataplane("memory")
    )
    assert (plan.snapshot, plan.ready, sorted(plan.partial)) == (info.name, [0], [1, 2])


def test_an_exit_fault_kills_the_actor_and_a_new_one_cannot_publish(
    ray_session: Any, tmp_path: Path
) -> None:
    """ROLLSAFE_FAULT reaches the actor's process; after the crash between capture and its
    stored result, a restarted controller has no draft: publish says take it again."""
    ray = ray_session
    run_id = "ray-fault"
    spec = SnapshotSpec(run_id=run_id, seq=1)
    env = {"env_vars": {ENV_VAR: "phase.capture.after"}}
    doomed = start_controller_actor(run_id, config(run_id), tmp_path, runtime_env=env)
    for phase in PHASES[: PHASES.index(Phase.CAPTURE)]:
        ray.get(doomed.run_phase.remote(PhaseRequest(spec=spec, phase=phase)))
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(doomed.run_phase.remote(PhaseRequest(spec=spec, phase=Phase.CAPTURE)))

    # A dead actor keeps its name while handles to it live; kill releases it.
    ray.kill(doomed)
    fresh = start_controller_actor(run_id, config(run_id), tmp_path)
    try:
        with pytest.raises(SnapshotLost) as caught:
            ray.get(fresh.run_phase.remote(PhaseRequest(spec=spec, phase=Phase.PUBLISH)))
        assert caught.value.transient
        resumed = ray.get(fresh.run_phase.remote(PhaseRequest(spec=spec, phase=Phase.RESUME)))
        assert "did not hold it" in resumed.summary
    finally:
        ray.kill(fresh)


def test_looking_up_a_run_without_an_actor(ray_session: Any) -> None:
    with pytest.raises(ControllerUnavailable, match=actor_name("nobody")):
        get_controller_actor("nobody")


class FutureController:
    """A controller actor of a release two contracts ahead: its process says so."""

    def __init__(self) -> None:
        from rollsafe import versions

        versions.THIS = versions.Peer(release="9.9.9", contract=versions.CONTRACT + 2)

    def next_seq(self) -> int:
        return 1


class EarlierController:
    """A controller actor of a release before contracts (no rollsafe.versions) whose calls
    differ, as 85646f7's did: ``run_phase`` takes other arguments."""

    def __init__(self) -> None:
        sys.modules["rollsafe.versions"] = None  # type: ignore[assignment]

    def next_seq(self) -> int:
        return 7

    def run_phase(self, request: object, lease_s: float, extra: object) -> None:
        raise AssertionError("never called: Ray refuses the arguments first")


def named_actor(ray: Any, cls: type, run_id: str) -> Any:
    return ray.remote(cls).options(name=actor_name(run_id), namespace=NAMESPACE).remote()


async def test_a_worker_asks_the_actor_once_and_refuses_one_two_contracts_apart(
    ray_session: Any, tmp_path: Path
) -> None:
    ray = ray_session
    this = start_controller_actor("contract-now", config("contract-now"), tmp_path)
    future = named_actor(ray, FutureController, "contract-future")
    try:
        client = RayControllerClient("contract-now")
        assert await client.next_seq() == 1 and await client.next_seq() == 1
        assert len(client._checked) == 1  # asked once, not per call
        with pytest.raises(VersionSkew) as skew:
            await RayControllerClient("contract-future").next_seq()
        assert str(skew.value).startswith(
            "the controller actor of run 'contract-future' is rollsafe 9.9.9 "
            f"(contract {CONTRACT + 2}); this process is rollsafe "
        )
        assert not skew.value.transient  # not retried without end
    finally:
        ray.kill(this)
        ray.kill(future)


async def test_an_actor_before_contracts_works_until_a_call_it_cannot_take(
    ray_session: Any,
) -> None:
    ray = ray_session
    earlier = named_actor(ray, EarlierController, "contract-earlier")
    try:
        client = RayControllerClient("contract-earlier")
        assert await client.next_seq() == 7  # contract 1: one apart, so it is tried
        request = PhaseRequest(
            spec=SnapshotSpec(run_id="contract-earlier", seq=1), phase=Phase.OPEN
        )
        with pytest.raises(VersionSkew, match=r"cannot take run_phase: TypeError: .*argument"):
            await client.run_phase(request)
    finally:
        ray.kill(earlier)
