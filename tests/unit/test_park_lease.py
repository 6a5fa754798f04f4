"""The environments' park lease is renewed by the same heartbeat as the admission lease
(``Controller.renew_admission``): a park window that outlives the park deadline (a slow cut, a
large commit) commits while its snapshot's worker heartbeats, and ends by itself once the
heartbeats stop. Two real participant apps (rollsafe.env.router) on ``httpx.ASGITransport``,
whose clock the test holds: the commit is sent at a moment past the lease the prepare granted
and before the renewed one."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rollsafe.checkpoint.controller import Controller
from rollsafe.checkpoint.participants import ParticipantOptions, Participants
from rollsafe.core.config import RunConfig
from rollsafe.core.phases import PHASES, Phase, PhaseRequest, SnapshotSpec
from rollsafe.env.client import EnvClient
from rollsafe.env.fleet import EnvFleet
from rollsafe.env.participant import Participant
from rollsafe.env.router import participant_app
from rollsafe.errors import CheckpointSpent
from rollsafe.loop_thread import LoopThread
from rollsafe.testing.clock import HeldClock
from rollsafe.testing.envs import Idle
from rollsafe.testing.waiting import eventually

RUN, TOKEN = "park-lease", "park-token"
INSTANCES = ("w0", "w1")
SPEC = SnapshotSpec(run_id=RUN, seq=1)
# Short, so a renewal may go out (one per quarter of it) a few milliseconds after the prepare.
PARK_DEADLINE_S = 0.04


@dataclass
class Run:
    controller: Controller
    clients: dict[str, EnvClient]
    loop: LoopThread
    clock: HeldClock

    def phase(self, phase: Phase) -> object:
        return self.controller.run_phase(PhaseRequest(spec=SPEC, phase=phase))

    def lease_ends(self) -> float:
        """The earliest lease end among the instances."""

        async def statuses() -> list[float]:
            replies = [await c.status() for c in self.clients.values()]
            return [r.lease_expires_ts for r in replies if r.lease_expires_ts is not None]

        return min(self.loop.run(statuses()))


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    clock, loop = HeldClock(), LoopThread("park-lease-test")
    clock.now = time.time() - 1.0  # before any deadline the controller sends (within the cap)

    async def clients() -> dict[str, EnvClient]:
        by_name = {}
        for name in INSTANCES:
            app = participant_app(Participant(name, Idle(), lease_grace_s=0.0, clock=clock), TOKEN)
            transport = httpx.ASGITransport(app=app)
            by_name[name] = EnvClient(f"http://{name}.test", TOKEN, transport=transport)
        return by_name

    by_name = loop.run(clients())
    fleet = EnvFleet(by_name)
    options = ParticipantOptions(park_deadline_s=PARK_DEADLINE_S)
    participants = Participants(fleet, {}, loop=loop, options=options)
    config = RunConfig(run_id=RUN, group_size=2, groups_per_step=1)
    try:
        yield Run(Controller(config, tmp_path, participants=participants), by_name, loop, clock)
    finally:
        loop.run(fleet.aclose())
        loop.close()


def park(run: Run) -> float:
    """Every phase before commit_envs; the lease end the prepare granted."""
    for phase in PHASES[: PHASES.index(Phase.COMMIT_ENVS)]:
        run.phase(phase)
    return run.lease_ends()


def test_heartbeats_renew_the_park_lease_past_the_park_deadline(run: Run) -> None:
    granted = park(run)

    def heartbeat_renewed() -> bool:
        assert run.controller.renew_admission(SPEC)  # the gate is held: always renewed
        return run.lease_ends() > granted

    eventually(heartbeat_renewed, what="a heartbeat renewing the park lease")
    run.clock.now = (granted + run.lease_ends()) / 2  # past the prepare's lease, not the renewal's
    run.phase(Phase.COMMIT_ENVS)
    for phase in PHASES[PHASES.index(Phase.COMMIT_ENVS) + 1 :]:
        run.phase(phase)
    assert run.controller.store.list()  # published


def test_without_heartbeats_the_park_lease_ends_the_park_by_name(run: Run) -> None:
    granted = park(run)
    run.clock.now = granted + PARK_DEADLINE_S / 2
    with pytest.raises(CheckpointSpent, match="park lease ran out before the commit"):
        run.phase(Phase.COMMIT_ENVS)


def test_a_checkpoint_that_does_not_hold_the_gate_renews_nothing(run: Run) -> None:
    granted = park(run)
    other = SnapshotSpec(run_id=RUN, seq=2)
    assert not run.controller.renew_admission(other)
    assert run.lease_ends() == granted
