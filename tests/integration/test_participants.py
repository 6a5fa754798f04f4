"""The controller's checkpoint phases with real environments and a real engine: one
``rollsafe engine serve`` and two ``rollsafe env serve workplace`` processes, episodes
dispatched through the admission gate while the ten phases run.

A snapshot taken mid-run parks every instance, cuts the calls still generating and stages
their prefixes, commits the parked episodes into the snapshot (hashed into its manifest), and
resumes everything: every episode then finishes and seals. After the environment servers are
SIGKILLed and replaced, a restore brings the committed episodes back as attempt n + 1 on their
own instances, the cut calls continue from their staged prefixes, and the controller's plan
lists exactly those rollouts as resumed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollsafe.checkpoint.controller import Controller
from rollsafe.checkpoint.participants import ParticipantOptions, Participants, to_episode, to_ref
from rollsafe.checkpoint.phases.commit_envs import RECORD_FILE, ParticipantsRecord
from rollsafe.core.config import RunConfig
from rollsafe.core.ids import EpisodeId
from rollsafe.core.phases import (
    PHASES,
    Phase,
    PhaseRequest,
    PhaseResult,
    RestoreRequest,
    SnapshotSpec,
)
from rollsafe.core.states import AttemptState
from rollsafe.dataplane.protocol import DataPlaneManifest
from rollsafe.engine.http import CUT_RECEIVED, EngineClient
from rollsafe.engine.loop import HOLD_ENV, HoldRule
from rollsafe.engine.staging import PREFIX_PARTITION
from rollsafe.env.client import EnvClient
from rollsafe.env.fleet import EnvFleet
from rollsafe.env.protocol import EpisodeRef, EpisodeResult, RunEpisode
from rollsafe.errors import EnvUnavailable
from rollsafe.faults import ENV_VAR as FAULT_ENV
from rollsafe.http.bearer import ENGINE_TOKEN_ENV, ENV_TOKEN_ENV
from rollsafe.http.served import ENGINE_BANNER, ENV_BANNER, ServedProcess, start_served
from rollsafe.loop_thread import LoopThread
from rollsafe.testing.waiting import eventually, eventually_async

RUN = "with-envs"
ENGINE_TOKEN, ENV_TOKEN = "pt-engine", "pt-env"
TOKENS = {ENGINE_TOKEN_ENV: ENGINE_TOKEN, ENV_TOKEN_ENV: ENV_TOKEN}  # never on a command line
INSTANCES = ("w0", "w1")
GROUPS, GROUP_SIZE, TURNS = 4, 2, 16
DRIVE_TIMEOUT_S = 120.0  # how long the test waits for an episode's run (admission included)
# Every episode stops two turns in, a token into its call, until the snapshot's cut: the one
# snapshot taken then finds every episode mid-call, on an idle machine or a loaded one.
TWO_TURNS_IN = HoldRule(calls=r"/t([2-9]|\d\d)")


class Servers:
    def __init__(self, logs: Path, engine_env: dict[str, str] | None = None) -> None:
        self.logs = logs
        self.started: list[ServedProcess] = []
        self.engine = self.start_engine(engine_env or {})
        self.envs: dict[str, ServedProcess] = {}
        self.start_envs()

    def start_engine(self, env: dict[str, str], *, hold: bool = True) -> ServedProcess:
        """An engine (the same seed: the same model), holding calls two turns in until the
        first cut unless told not to."""
        args = ["engine", "serve", "--port", "0", "--seed", "1"]
        held = {HOLD_ENV: TWO_TURNS_IN.model_dump_json()} if hold else {}
        banner = ENGINE_BANNER.format(kind="dense")
        return self._start(args, banner, "engine", {**held, **TOKENS, **env})

    def _start(
        self, args: list[str], banner: str, name: str, env: dict[str, str] | None = None
    ) -> ServedProcess:
        server = start_served(args, banner, self.logs / f"{name}-{len(self.started)}", env=env)
        self.started.append(server)
        return server

    def start_envs(self) -> None:
        for name in INSTANCES:
            args = ["env", "serve", "workplace", "--port", "0", "--engine-url", self.engine.url]
            args += ["--instance", name, "--lease-grace-s", "2"]
            banner = ENV_BANNER.format(name="workplace", instance=name)
            self.envs[name] = self._start(args, banner, name, TOKENS)

    def crash_envs(self) -> None:
        for server in self.envs.values():
            server.crash()


@pytest.fixture
def servers(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Servers]:
    """The servers; a test marked ``engine_fault(SPEC)`` has its first engine armed with it."""
    marker = request.node.get_closest_marker("engine_fault")
    engine_env = {FAULT_ENV: marker.args[0]} if marker is not None else None
    running = Servers(tmp_path / "logs", engine_env)
    try:
        yield running
    finally:
        for server in running.started:
            server.stop()


class Run:
    """A controller service with participants, and a dispatcher on the participants' loop."""

    def __init__(
        self, servers: Servers, root: Path, *, journal: bool, drain_timeout_s: float = 5
    ) -> None:
        self.loop = LoopThread()
        self.fleet, self.engine = self.loop.run(self._clients(servers))
        options = ParticipantOptions(park_deadline_s=20, drain_timeout_s=drain_timeout_s)
        self.participants = Participants(
            self.fleet, {"e0": self.engine}, loop=self.loop, options=options
        )
        config = RunConfig(
            run_id=RUN, group_size=GROUP_SIZE, groups_per_step=2, restore_level="prefix"
        )
        config = config.model_copy(update={"journal": journal})
        self.service = Controller(config, root, participants=self.participants)

    @staticmethod
    async def _clients(servers: Servers) -> tuple[EnvFleet, EngineClient]:
        clients = {name: EnvClient(s.url, ENV_TOKEN) for name, s in servers.envs.items()}
        return EnvFleet(clients), EngineClient(servers.engine.url, ENGINE_TOKEN)

    def instance(self, idx: int, i: int) -> str:
        return INSTANCES[(idx * GROUP_SIZE + i) % len(INSTANCES)]

    async def _drive(self, idx: int, i: int) -> EpisodeResult:
        """Dispatch through the gate (waiting while it is closed), run, seal, then mark the
        reply done: sealed before done, so a drain never ends with a reply unaccounted for."""
        instance = self.instance(idx, i)
        # dispatch returns None while admission is closed (a snapshot is open): retried until
        # the gate admits it, as a trainer's dispatcher does, for as long as the test waits.
        episode: EpisodeId | None = await eventually_async(
            lambda: asyncio.to_thread(self.service.dispatch, idx, i, instance),
            timeout_s=DRIVE_TIMEOUT_S,
            what=f"admission of rollout {i} of group {idx}",
        )
        return await self._run(idx, i, episode, instance)

    async def _run(self, idx: int, i: int, episode: Any, instance: str) -> EpisodeResult:
        ref = to_ref(episode)
        self.participants.pending.add(ref, instance)
        try:
            task = {"seed": 100 + idx, "turns": TURNS}
            run = RunEpisode(episode=ref, task=task)
            result = await self.fleet.run_episode(instance, run, max_wait_s=60)
            tokens = [t for turn in result.info["history"] for t in turn["tokens"]]
            row = {
                "tokens": np.array(tokens, np.int32),
                "reward": np.array(result.reward, np.float32),
            }
            await asyncio.to_thread(self.service.seal, idx, i, episode.attempt, row)
            return result
        finally:
            self.participants.pending.done(ref)

    def drive(self, idx: int, i: int) -> Future[EpisodeResult]:
        return asyncio.run_coroutine_threadsafe(self._drive(idx, i), self.loop.loop)

    def close(self) -> None:
        async def close_clients() -> None:
            await self.fleet.aclose()
            await self.engine.aclose()

        self.loop.run(close_clients())
        self.loop.close()


@dataclass
class FirstLife:
    """The first run: the snapshot that caught a call mid-generation, and how it ended."""

    service: Controller
    results: dict[Phase, PhaseResult]  # the snapshot's phases
    snapshot: Path
    record: ParticipantsRecord
    finished: list[EpisodeResult]


def snapshot_mid_run(servers: Servers, root: Path, *, journal: bool) -> FirstLife:
    """Run every episode; snapshot once every one is held mid-call (the snapshot cuts those
    calls, which ends the engine's hold); let them all finish after the snapshot resumed
    them."""
    first = Run(servers, root, journal=journal)
    try:
        running, results = every_call_held_then_a_snapshot(first)
        published = results[Phase.PUBLISH].published
        assert published is not None
        snapshot = Path(published.path)
        record = ParticipantsRecord.model_validate_json((snapshot / RECORD_FILE).read_bytes())
        finished = [future.result(timeout=DRIVE_TIMEOUT_S) for future in running]
    finally:
        first.close()
    return FirstLife(first.service, results, snapshot, record, finished)


def every_call_held_then_a_snapshot(
    first: Run,
) -> tuple[list[Future[EpisodeResult]], dict[Phase, PhaseResult]]:
    """Every episode dispatched; once each is held mid-call, one snapshot's ten phases. The
    episodes' runs, and the phases' results."""
    first.service.handout(list(range(GROUPS)))
    running = [first.drive(idx, i) for idx in range(GROUPS) for i in range(GROUP_SIZE)]
    eventually(
        lambda: first.loop.run(first.engine.info()).held == len(running),
        what="every episode held two turns in",
    )
    spec = SnapshotSpec(run_id=RUN, seq=1)
    return running, {p: first.service.run_phase(PhaseRequest(spec=spec, phase=p)) for p in PHASES}


def check_the_snapshot_and_the_first_life(life: FirstLife) -> set[EpisodeRef]:
    """What the snapshot holds, and that every episode of the first life sealed; the refs of
    the episodes it committed."""
    record, results, snapshot = life.record, life.results, life.snapshot
    assert record.staged, "no snapshot caught a call mid-generation"
    parked = results[Phase.PREPARE_ENVS].counts["parked"]
    assert parked > 0, results[Phase.PREPARE_ENVS].summary
    manifest_files = set(life.service.store.select().manifest.files)
    assert RECORD_FILE in manifest_files
    assert {f.split("/")[1] for f in manifest_files if f.startswith("envs/")} == set(INSTANCES)
    committed = {ref for c in record.committed.instances.values() for ref in c.committed}
    assert len(committed) == parked
    assert len(record.staged) == results[Phase.CUT_GENERATION].counts["cut"]
    # The staged prefixes are in the snapshot only: the live data plane let them go at resume.
    exported = DataPlaneManifest.model_validate_json((snapshot / "dataplane.json").read_bytes())
    assert exported.partitions[PREFIX_PARTITION] == len(record.staged)
    assert life.service.state.dataplane.count(PREFIX_PARTITION) == 0
    # After resume, every episode of the first life finished and sealed.
    assert len(life.finished) == GROUPS * GROUP_SIZE
    ledger = life.service.state.ledger
    assert all(ledger.states(idx) == [AttemptState.SEALED] * GROUP_SIZE for idx in range(GROUPS))
    return committed


def restore_onto_fresh_envs(
    servers: Servers, root: Path, committed: set[EpisodeRef]
) -> dict[tuple[int, int], EpisodeResult]:
    """Crash every environment server; restore from the snapshot onto fresh ones; run the
    resumed rollouts to their end. Their results, by (group, rollout)."""
    servers.crash_envs()
    servers.start_envs()
    second = Run(servers, root, journal=False)
    try:
        plan = second.service.restore(RestoreRequest(run_id=RUN, restore_id="restore-1"))
        # Handed to the environments, then dropped from the live data plane too.
        assert second.service.state.dataplane.count(PREFIX_PARTITION) == 0
        resumed = {(idx, i) for idx, g in plan.partial.items() for i in g.resumed}
        expected = {(e.rollout.group.idx, e.rollout.i) for e in map(to_episode, committed)}
        assert resumed == expected
        # Redispatched through the gate as attempt 1, on the instance that restored it.
        again = {(idx, i): second.drive(idx, i) for idx, i in sorted(resumed)}
        return {key: future.result(timeout=DRIVE_TIMEOUT_S) for key, future in again.items()}
    finally:
        second.close()


def check_the_restored_episodes(
    outcomes: dict[tuple[int, int], EpisodeResult], record: ParticipantsRecord
) -> None:
    """Every restored episode ran as attempt 1, each turn once; each cut call continued from
    its staged prefix."""
    for (idx, i), result in outcomes.items():
        assert result.restored and result.episode.attempt == 1, (idx, i)
        assert result.turns == TURNS
        turns = [turn["turn"] for turn in result.info["history"]]
        assert turns == list(range(TURNS)), (idx, i)  # every turn once, none repeated
    staged_calls = set(record.staged)
    resumed_from = {
        call: tokens
        for result in outcomes.values()
        for call, tokens in result.info["attempt"]["resumed_from"].items()
    }
    # Each cut call continued from its staged prefix (its tokens were not generated again).
    assert all(resumed_from.get(call, 0) == record.staged[call] for call in staged_calls)


def test_phases_park_cut_commit_and_a_restore_brings_the_episodes_back(
    servers: Servers, tmp_path: Path
) -> None:
    # The snapshot's own restore path: without the journal, which would keep the seals made
    # after the snapshot and leave nothing to resume (the test below).
    life = snapshot_mid_run(servers, tmp_path / "snapshots", journal=False)
    committed = check_the_snapshot_and_the_first_life(life)
    outcomes = restore_onto_fresh_envs(servers, tmp_path / "snapshots", committed)
    check_the_restored_episodes(outcomes, life.record)


def test_with_the_journal_what_sealed_after_the_snapshot_is_kept_not_resumed(
    servers: Servers, tmp_path: Path
) -> None:
    """Every episode the snapshot parked sealed after it: the journal brings the seals back,
    and the environments are asked to restore none of those episodes (restored as well,
    they would be a second life of a sealed rollout)."""
    root = tmp_path / "snapshots"
    life = snapshot_mid_run(servers, root, journal=True)
    check_the_snapshot_and_the_first_life(life)
    servers.crash_envs()
    servers.start_envs()
    second = Run(servers, root, journal=True)
    try:
        plan = second.service.restore(RestoreRequest(run_id=RUN, restore_id="restore-1"))
        assert plan.journal is not None and plan.journal.records >= GROUPS * GROUP_SIZE
        assert not any(group.resumed for group in plan.partial.values())
        ledger = second.service.state.ledger
        assert all(
            ledger.states(idx) == [AttemptState.SEALED] * GROUP_SIZE for idx in range(GROUPS)
        )
        assert sorted(plan.ready) == list(range(GROUPS))
    finally:
        second.close()


@pytest.mark.timeout(120)  # a drain that waited would hang here (its timeout is an hour)
def test_with_the_journal_the_drain_does_not_wait_for_a_reply_on_the_wire(
    servers: Servers, tmp_path: Path
) -> None:
    """An episode whose reply is on the wire (dispatched, outside the commit scope, not
    sealed) does not hold the park window when the run keeps a journal: the drain names it and
    goes on; the reply lands after the snapshot and seals into the journal, and a restore from
    the snapshot and the journal has the rollout sealed, not to run again."""
    root = tmp_path / "snapshots"
    first = Run(servers, root, journal=True, drain_timeout_s=3600)
    try:
        first.service.handout([0])
        instance = first.instance(0, 0)
        episode = first.service.dispatch(0, 0, instance)
        assert episode is not None
        first.participants.pending.add(to_ref(episode), instance)  # sent, no reply yet
        spec = SnapshotSpec(run_id=RUN, seq=1)
        results = {p: first.service.run_phase(PhaseRequest(spec=spec, phase=p)) for p in PHASES}
        assert results[Phase.PUBLISH].published is not None
        drain = results[Phase.DRAIN]
        assert drain.counts["stragglers"] == 1 and "journal" in drain.summary, drain.summary
        row = {"tokens": np.array([5, 6, 7], np.int32), "reward": np.array(1.0, np.float32)}
        first.service.seal(0, 0, episode.attempt, row)  # the reply lands after the snapshot
        first.participants.pending.done(to_ref(episode))
    finally:
        first.close()
    second = Run(servers, root, journal=True)
    try:
        plan = second.service.restore(RestoreRequest(run_id=RUN, restore_id="restore-1"))
        assert plan.journal is not None and plan.journal.records >= 1
        assert second.service.state.ledger.states(0)[0] == AttemptState.SEALED
        assert plan.partial[0].restored == [0] and 0 not in plan.partial[0].regenerate
    finally:
        second.close()


@pytest.mark.engine_fault(f"{CUT_RECEIVED}:exit")
def test_an_engine_that_dies_mid_cut_leaves_its_calls_at_turn_level_and_loses_none(
    servers: Servers, tmp_path: Path
) -> None:
    """Issue 22, part 3. The engine dies as the cut reaches it (fault point
    ``engine.cut.received:exit``): the cut commits every call at turn level, named
    (``engine_unavailable``), the snapshot publishes, and resume names the engine it could
    not release on. The episodes' calls fail after resume (their runs fail, to be sent
    again). Restored onto a new engine, each episode makes its interrupted call again from
    its turn: every turn once, no token from a prefix (none was staged: nothing resumed
    twice)."""
    root = tmp_path / "snapshots"
    first = Run(servers, root, journal=False)
    try:
        running, results = every_call_held_then_a_snapshot(first)
        for future in running:  # the engine is gone: each run fails after resume
            with pytest.raises(EnvUnavailable, match=r"503|engine"):
                future.result(timeout=DRIVE_TIMEOUT_S)
    finally:
        first.close()
    cut = results[Phase.CUT_GENERATION].counts
    assert cut["cut"] == 0 and cut["failed"] == len(running), cut
    assert "engine e0 did not release" in results[Phase.RESUME].summary
    published = results[Phase.PUBLISH].published
    assert published is not None
    record = ParticipantsRecord.model_validate_json(
        (Path(published.path) / RECORD_FILE).read_bytes()
    )
    assert not record.staged and set(record.refused.values()) == {"engine_unavailable"}
    committed = {ref for c in record.committed.instances.values() for ref in c.committed}
    assert len(committed) == len(running)

    servers.engine = servers.start_engine({}, hold=False)  # a new one, the same model
    servers.crash_envs()
    servers.start_envs()
    second = Run(servers, root, journal=False)
    try:
        plan = second.service.restore(RestoreRequest(run_id=RUN, restore_id="restore-1"))
        resumed = {(idx, i) for idx, g in plan.partial.items() for i in g.resumed}
        assert resumed == {(e.rollout.group.idx, e.rollout.i) for e in map(to_episode, committed)}
        again = {(idx, i): second.drive(idx, i) for idx, i in sorted(resumed)}
        outcomes = {key: future.result(timeout=DRIVE_TIMEOUT_S) for key, future in again.items()}
    finally:
        second.close()
    for key, result in outcomes.items():
        assert result.restored and result.episode.attempt == 1 and result.turns == TURNS, key
        history = result.info["history"]
        assert [turn["turn"] for turn in history] == list(range(TURNS)), key
        assert not result.info["attempt"]["resumed_from"], key
