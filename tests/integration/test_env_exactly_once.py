"""Exactly once across real processes: one ``rollsafe engine serve`` (MoE) and three
``rollsafe env serve workplace`` instances (``w0``, ``w1``, ``w2``), driven by :class:`EnvFleet`.

* A fleet checkpointed mid-run (prepare, cut, commit), then crashed (SIGKILL) and restored on
  fresh servers, finishes every committed episode as attempt n + 1 on its original instance:
  each turn mutates exactly once, the cut calls resume from their prefixes (not regenerated),
  and every episode ends bit for bit where the same episode run uninterrupted ends.
* A restore that fails on one of three instances leaves no restored state anywhere.
* A run refused while its instance is parked is re-sent, identical, once the instance resumes.
* A lease nobody renews reopens a parked instance by itself; its checkpoint id is then dead.
* A retired rollout is refused until forgotten; a resumed checkpoint id is refused forever.

Every server is a subprocess stopped by pid (terminate, wait, kill) in a finalizer, never by
name. The engine stays up across the env crash on purpose: that is the harder case, because it
still holds the calls the checkpoint froze, and the restored attempts' resumes must supersede
them (the torch engine lets a resume with a prefix replace a frozen call of the same id).

Nothing is left to timing: the checkpoints taken mid-run are taken once the engine holds the
calls they must catch (``ROLLSAFE_ENGINE_HOLD``: two turns in, a token into the call, until the
checkpoint's cut), so one checkpoint always finds every episode mid-call. The hold ends at an
engine's first cut, so the restore-failure test, which cuts too, has an engine of its own.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollsafe.dataplane.memory import MemoryDataPlane
from rollsafe.engine.http import EngineClient
from rollsafe.engine.loop import HOLD_ENV, HoldRule
from rollsafe.engine.protocol import PrefixRecord
from rollsafe.engine.staging import StagedCut, cut_and_stage, load_prefixes
from rollsafe.env.client import EnvClient
from rollsafe.env.fleet import EnvFleet
from rollsafe.env.fleet_rules import FleetPrepared
from rollsafe.env.protocol import (
    EPISODES_RUN,
    PREFIX,
    CommitRequest,
    EpisodeRef,
    EpisodeResult,
    ParkedEpisode,
    PrepareRequest,
    RenewRequest,
    RestoreRequest,
    ResumeRequest,
    RunEpisode,
)
from rollsafe.errors import EnvRefused, EnvUnavailable
from rollsafe.http.served import ENGINE_BANNER, ENV_BANNER, ServedProcess, rollsafe_command
from rollsafe.reference.envs.workplace.calendar import Task, action_from_tokens, apply, new_calendar
from rollsafe.reference.envs.workplace.calendar import reward as score
from rollsafe.testing.waiting import eventually_async

ENGINE_TOKEN = "eo-engine-token"
ENV_TOKEN = "eo-env-token"
INSTANCES = ("w0", "w1", "w2")
LEASE_GRACE_S = 1.0
EPISODE_TIMEOUT_S = 60.0  # any one gather of episodes; far above what they take
FROZEN: set[str] = set()  # every call a test cut
# The module's engine holds the calls of the checkpointed episodes of test 1 from their third
# turn on, after a token, until the checkpoint cuts them: attempt 0 of eo-* only (a later
# attempt's key ends in -a<n>), so neither test 1's uninterrupted run (another attempt) nor
# its restored attempts nor any other test's episodes are held. Its cut ends the hold.
EO_MID_RUN = HoldRule(calls=r"^eo-\d+_g\d+/t([2-9]|\d\d)$")
# The attempt of test 1's uninterrupted run: the same rollout ids (so the same calls' seeds),
# not the checkpointed attempt 0 (held) nor the restored attempt 1.
REFERENCE_ATTEMPT = 9
# Test 2's own engine holds its episodes the same way.
RF_MID_RUN = HoldRule(calls=r"^rf-\d+_g0/t([2-9]|\d\d)$")


# -- server processes ---------------------------------------------------------------------------


class Trio:
    """The three workplace instances; a crash replaces them with fresh processes under the same
    instance ids. Every process ever started is stopped by the module's finalizer."""

    def __init__(self, engine: ServedProcess, logs: Path) -> None:
        self.engine, self.logs = engine, logs
        self.started: list[ServedProcess] = []
        self.current: dict[str, ServedProcess] = {}
        self.generation = 0

    def start(self, names: Sequence[str]) -> None:
        self.generation += 1
        spawned = {name: self._spawn(name) for name in names}  # all at once, then wait for each
        for name, server in spawned.items():
            banner = ENV_BANNER.format(name="workplace", instance=name)
            self.current[name] = server.wait_listening(banner)

    def _spawn(self, instance: str) -> ServedProcess:
        args = ["env", "serve", "workplace", "--port", "0"]
        args += ["--engine-url", self.engine.url, "--instance", instance]
        args += ["--lease-grace-s", str(LEASE_GRACE_S)]
        logs = self.logs / f"{instance}-{self.generation}"
        tokens = {"ROLLSAFE_ENV_TOKEN": ENV_TOKEN, "ROLLSAFE_ENGINE_TOKEN": ENGINE_TOKEN}
        server = ServedProcess(rollsafe_command(*args), logs, tokens)
        self.started.append(server)
        return server

    def ensure_alive(self) -> None:
        dead = [n for n in INSTANCES if n not in self.current or not self.current[n].alive()]
        if dead:  # an earlier test failed mid-crash: later tests still get three instances
            self.start(dead)

    def crash_all(self) -> None:
        for server in self.current.values():
            server.crash()

    def fleet(self, **client: Any) -> EnvFleet:
        return EnvFleet(
            {name: EnvClient(s.url, ENV_TOKEN, **client) for name, s in self.current.items()}
        )

    def client(self, name: str, **client: Any) -> EnvClient:
        return EnvClient(self.current[name].url, ENV_TOKEN, **client)


def start_engine(logs: Path, hold: HoldRule) -> ServedProcess:
    """``rollsafe engine serve`` (MoE, seed 1) holding the calls ``hold`` names until its
    first cut; stopped (by pid) if it does not start."""
    args = ["engine", "serve", "--port", "0", "--model", "moe", "--seed", "1"]
    env = {HOLD_ENV: hold.model_dump_json(), "ROLLSAFE_ENGINE_TOKEN": ENGINE_TOKEN}
    server = ServedProcess(rollsafe_command(*args), logs, env=env)
    return server.wait_listening(ENGINE_BANNER.format(kind="moe"))


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    server = start_engine(tmp_path_factory.mktemp("eo-engine"), EO_MID_RUN)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def trio(engine_server: ServedProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    servers = Trio(engine_server, tmp_path_factory.mktemp("eo-envs"))
    try:
        servers.start(INSTANCES)
        yield servers
    finally:
        for server in servers.started:
            server.stop()


@pytest.fixture
async def fleet(trio: Trio, engine: EngineClient) -> AsyncIterator[EnvFleet]:
    trio.ensure_alive()
    async with trio.fleet() as envs:
        yield envs
    # A test that failed with a checkpoint open must not leave the next one parked.
    async with trio.fleet(timeout_s=5) as current:
        for name in current.names:
            with suppress(EnvUnavailable):
                status = await current._client(name).status()
                if status.checkpoint_id is not None:
                    resume = ResumeRequest(checkpoint_id=status.checkpoint_id)
                    await current._client(name).resume(resume)
        if FROZEN:
            await engine.release(sorted(FROZEN))
            FROZEN.clear()


@pytest.fixture
async def engine(engine_server: ServedProcess) -> AsyncIterator[EngineClient]:
    async with EngineClient(engine_server.url, ENGINE_TOKEN) as client:
        yield client


@dataclass
class Own:
    """A test's own engine (holding what its HoldRule names) and instances, as clients."""

    fleet: EnvFleet
    engine: EngineClient


@pytest.fixture
async def rf_servers(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Own]:
    """An engine holding test 2's episodes mid-run (the module engine's hold is spent by test
    1's cut) and three instances on it, all stopped by pid at the end."""
    engine_server = start_engine(tmp_path_factory.mktemp("rf-engine"), RF_MID_RUN)
    servers = Trio(engine_server, tmp_path_factory.mktemp("rf-envs"))
    try:
        servers.start(INSTANCES)
        async with servers.fleet() as envs, EngineClient(engine_server.url, ENGINE_TOKEN) as engine:
            yield Own(envs, engine)
    finally:
        for server in [*servers.started, engine_server]:
            server.stop()
        FROZEN.clear()  # what this engine froze went with it


# -- helpers ------------------------------------------------------------------------------------


def ref(rollout_id: str, attempt: int = 0) -> EpisodeRef:
    return EpisodeRef(rollout_id=rollout_id, attempt=attempt)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def bounded(aws: Any, timeout_s: float = EPISODE_TIMEOUT_S) -> Any:
    return await asyncio.wait_for(aws, timeout_s)


async def run_all(
    fleet: EnvFleet, placed: Mapping[EpisodeRef, tuple[str, dict[str, Any]]]
) -> dict[EpisodeRef, EpisodeResult]:
    """Every episode on its instance, at once."""
    runs = [
        fleet.run_episode(name, RunEpisode(episode=ep, task=task), max_wait_s=30)
        for ep, (name, task) in placed.items()
    ]
    results = await bounded(asyncio.gather(*runs))
    return dict(zip(placed, results, strict=True))


async def cut_parked(
    prepared: FleetPrepared,
    engine: EngineClient,
    dataplane: MemoryDataPlane,
    ours: set[str],
) -> tuple[StagedCut, dict[str, list[EpisodeRef]]]:
    """Cut every call of ``ours`` (rollout ids) still generating and stage its prefix; the
    commit scope per instance.

    Every parked episode is in the scope: one whose call could not be cut would hold its
    response until resume, so it would be exported as parked, in flight, and its restored
    attempt would make that call again (turn level). Restarts are never in the scope."""
    parked = {
        name: [p for p in inv.parked if p.episode.rollout_id in ours]
        for name, inv in prepared.instances.items()
    }
    generating = [
        p.model_call_id
        for held in parked.values()
        for p in held
        if p.activity == "generating" and p.model_call_id is not None
    ]
    FROZEN.update(generating)  # released by the fixture if the test fails before it does
    staged = await cut_and_stage(engine, generating, dataplane)
    scope = {name: [p.episode for p in held] for name, held in parked.items()}
    return staged, scope


async def checkpoint_mid_run(
    fleet: EnvFleet, engine: EngineClient, prefix: str, ours: set[str]
) -> tuple[str, FleetPrepared, MemoryDataPlane, StagedCut, dict[str, list[EpisodeRef]]]:
    """Once the engine holds a call of every episode of ``ours`` (rollout ids; its HoldRule
    names them), prepare all and cut: the id, inventory, data plane, cut and scope. Held, the
    episodes stay mid-call until the cut: the one checkpoint finds every instance mid-run and
    cuts every call (which ends the engine's hold: released, the calls go on)."""

    async def all_held() -> bool:
        return (await engine.info()).held == len(ours)

    await eventually_async(all_held, what=f"the engine holding a call of each of {sorted(ours)}")
    checkpoint = unique(prefix)
    prepared = await fleet.prepare_all(checkpoint, time.time() + 20)
    dataplane = MemoryDataPlane()
    staged, scope = await cut_parked(prepared, engine, dataplane, ours)
    assert all(scope[name] for name in fleet.names), f"an instance with nothing parked: {scope}"
    assert len(staged.staged) == len(ours) and not staged.refused, staged
    return checkpoint, prepared, dataplane, staged, scope


def replayed(result: EpisodeResult, task: dict[str, Any]) -> None:
    """The mutation log holds every turn exactly once, and replaying the episode's generated
    tokens through the pure calendar gives exactly its log, calendar and reward."""
    task_ = Task.model_validate(task)
    turns = Counter(m["turn"] for m in result.info["mutations"])
    assert turns == Counter(range(task_.turns)), f"{result.episode.key}: turns {turns}"
    calendar = new_calendar(task_)
    for turn, log in enumerate(result.info["history"]):
        assert log["turn"] == turn
        action = action_from_tokens(log["tokens"], calendar)
        calendar = apply(
            calendar,
            action,
            rollout_id=result.episode.rollout_id,
            turn=turn,
            call_id=log["call_id"],
        )
    mutations = [m.model_dump(mode="json", exclude={"rollout_id"}) for m in calendar.mutations]
    assert mutations == result.info["mutations"]
    assert [e.model_dump(mode="json") for e in calendar.events] == result.info["calendar"]
    assert score(calendar, task_) == result.reward


def same_play(a: EpisodeResult, b: EpisodeResult) -> None:
    """Same tokens every turn, same actions, same calendar, same reward; call ids may differ."""
    assert [h["tokens"] for h in a.info["history"]] == [h["tokens"] for h in b.info["history"]]
    strip = [{k: v for k, v in m.items() if k != "call_id"} for m in a.info["mutations"]]
    assert strip == [{k: v for k, v in m.items() if k != "call_id"} for m in b.info["mutations"]]
    assert (a.info["calendar"], a.reward, a.turns) == (b.info["calendar"], b.reward, b.turns)


# -- 1. crash and restore -----------------------------------------------------------------------


@dataclass
class Checkpointed:
    """A checkpoint taken mid-run and committed: what the crash and the restore start from."""

    checkpoint: str
    prepared: FleetPrepared
    dataplane: MemoryDataPlane
    staged: StagedCut
    scope: dict[str, list[EpisodeRef]]
    root: Path  # where the commit went
    parked: dict[str, ParkedEpisode]  # by rollout id
    in_scope: set[str]  # rollout ids


async def run_uninterrupted(
    fleet: EnvFleet,
    placed: Mapping[EpisodeRef, tuple[str, dict[str, Any]]],
    tasks: Mapping[str, dict[str, Any]],
) -> dict[str, EpisodeResult]:
    """Every episode run uninterrupted as attempt REFERENCE_ATTEMPT (the engine's hold names
    attempt 0 only), each replayed exactly (by rollout id)."""
    reference = {ref(ep.rollout_id, REFERENCE_ATTEMPT): where for ep, where in placed.items()}
    whole = {ep.rollout_id: r for ep, r in (await run_all(fleet, reference)).items()}
    for rollout_id, result in whole.items():
        assert not result.restored and result.turns == tasks[rollout_id]["turns"]
        replayed(result, tasks[rollout_id])
    return whole


async def checkpoint_and_commit(
    fleet: EnvFleet,
    engine: EngineClient,
    placed: Mapping[EpisodeRef, tuple[str, dict[str, Any]]],
    tasks: Mapping[str, dict[str, Any]],
    root: Path,
) -> tuple[dict[str, asyncio.Task[EpisodeResult]], Checkpointed]:
    """Start the episodes again (attempt 0), checkpoint them mid-run (once the engine holds
    each two turns in, none near its end), each parked on its home instance, and commit the
    checkpoint into ``root``: the running episodes, the checkpoint."""
    running = {
        ep.rollout_id: asyncio.create_task(
            fleet.run_episode(name, RunEpisode(episode=ep, task=task), max_wait_s=30)
        )
        for ep, (name, task) in placed.items()
    }
    checkpoint, prepared, dataplane, staged, scope = await checkpoint_mid_run(
        fleet, engine, "eo-ck", set(tasks)
    )
    parked = {p.episode.rollout_id: p for inv in prepared.instances.values() for p in inv.parked}
    in_scope = {ep.rollout_id for eps in scope.values() for ep in eps}
    assert any(0 < parked[r].turn < tasks[r]["turns"] for r in in_scope), "none mid-run"
    home = {ep.rollout_id: name for ep, (name, _) in placed.items()}
    for rollout_id in in_scope:
        assert prepared.owners()[rollout_id] == home[rollout_id]

    committed = await fleet.commit_all(checkpoint, scope, root)
    for name in INSTANCES:
        assert committed.instances[name].committed == tuple(scope[name])
        assert committed.instances[name].missing == ()
    return running, Checkpointed(
        checkpoint, prepared, dataplane, staged, scope, root, parked, in_scope
    )


async def crash_the_parked_fleet(
    trio: Trio, running: dict[str, asyncio.Task[EpisodeResult]], ck: Checkpointed
) -> None:
    """Every instance dies at once, parked, with its episodes in memory: the episodes the
    checkpoint holds die with it, those that ended before it did not."""
    await asyncio.to_thread(trio.crash_all)
    outcomes = await bounded(asyncio.gather(*running.values(), return_exceptions=True))
    for rollout_id, outcome in zip(running, outcomes, strict=True):
        if rollout_id in ck.prepared.owners():  # held by the instance: died with it
            assert isinstance(outcome, EnvUnavailable), (rollout_id, outcome)
        else:  # ended before prepare: nothing to restore
            assert isinstance(outcome, EpisodeResult), (rollout_id, outcome)


async def restore_and_finish(
    trio: Trio, ck: Checkpointed, tasks: Mapping[str, dict[str, Any]]
) -> tuple[dict[EpisodeRef, EpisodeResult], dict[str, PrefixRecord]]:
    """Fresh processes, same instance ids; only the commit and the data plane survive. Restore
    the checkpoint's scope as attempt 1 and run it to its end: the results, and the prefixes
    the restore handed over (by call id)."""
    await asyncio.to_thread(trio.start, INSTANCES)
    async with trio.fleet() as restarted:
        loaded = load_prefixes(ck.dataplane, ck.staged.staged)
        prefixes = {call: record.model_dump(mode="json") for call, record in loaded.items()}
        restore_id = unique("eo-rs")
        restored = await restarted.restore_all(
            restore_id, ck.checkpoint, ck.root, ck.scope, prefixes, time.time() + 20
        )
        assert restored.ok, restored.errors
        assert restored.restarts == ()
        for name in INSTANCES:
            assert restored.restored[name] == tuple(ep.next_attempt() for ep in ck.scope[name])
        await restarted.resume_all(restore_id)

        again = {
            ep: (name, tasks[ep.rollout_id])
            for name, eps in restored.restored.items()
            for ep in eps
        }
        return await run_all(restarted, again), loaded


def check_the_restored_episodes(
    results: dict[EpisodeRef, EpisodeResult],
    ck: Checkpointed,
    tasks: Mapping[str, dict[str, Any]],
    whole: dict[str, EpisodeResult],
    loaded: dict[str, PrefixRecord],
) -> None:
    """Each restored episode is attempt 1 of one in scope, played each turn exactly once and
    exactly as uninterrupted; turns before the checkpoint kept attempt 0's calls, a cut call
    resumed from its prefix."""
    staged = ck.staged
    for ep, result in results.items():
        rollout_id, park = ep.rollout_id, ck.parked[ep.rollout_id]
        assert result.episode == ep and ep.attempt == 1 and result.restored
        replayed(result, tasks[rollout_id])  # every turn exactly once, no gap
        same_play(result, whole[rollout_id])  # and exactly the uninterrupted episode
        history = result.info["history"]
        # A call the engine could not cut is made again by the new attempt (turn level).
        cut_call = park.model_call_id if park.model_call_id in staged.staged else None
        for turn, log in enumerate(history):
            # Turns done before the checkpoint keep attempt 0's call; a cut call is resumed
            # under its own id from its prefix; later turns (and an uncut call) are the new
            # attempt's calls.
            before = turn < park.turn or (turn == park.turn and cut_call is not None)
            expected = f"{rollout_id}/t{turn}" if before else f"{ep.key}/t{turn}"
            assert log["call_id"] == expected, (ep.key, turn, log)
            assert result.info["mutations"][turn]["call_id"] == expected
            if cut_call is not None and turn == park.turn:
                prefix = loaded[cut_call]
                resumed = result.info["attempt"]["resumed_from"]
                assert resumed == {cut_call: len(prefix.tokens)} and staged.staged[cut_call]
                assert tuple(log["tokens"][: len(prefix.tokens)]) == prefix.tokens
            else:
                assert log["call_id"] not in result.info["attempt"]["resumed_from"]
    assert {ep.rollout_id for ep in results} == ck.in_scope


async def test_exactly_once_across_a_killed_and_restored_fleet(
    trio: Trio, fleet: EnvFleet, engine: EngineClient, tmp_path: Path
) -> None:
    # Nine rollouts, three per instance, 6-8 turns each.
    placed = {
        ref(f"eo-{n}_g{n % 2}"): (INSTANCES[n % 3], {"seed": 11 + n, "turns": 6 + n % 3})
        for n in range(9)
    }
    tasks = {ep.rollout_id: task for ep, (_, task) in placed.items()}

    # The uninterrupted run first, with the SAME rollout ids (a call's seed comes from the
    # rollout id and the turn, never the attempt) under another attempt, which the engine
    # does not hold: the reference the restored episodes must match bit for bit.
    whole = await run_uninterrupted(fleet, placed, tasks)
    # The same episodes again (attempt 0), checkpointed mid-run and committed.
    running, ck = await checkpoint_and_commit(fleet, engine, placed, tasks, tmp_path / "commit")
    # The crash. The engine stays up (see the module docstring): it still holds the frozen
    # calls.
    await crash_the_parked_fleet(trio, running, ck)
    results, loaded = await restore_and_finish(trio, ck, tasks)
    check_the_restored_episodes(results, ck, tasks, whole, loaded)
    info = await engine.info()
    assert (info.active, info.frozen) == (0, 0)  # every frozen call was superseded and ended


# -- 2. all-or-nothing restore ------------------------------------------------------------------


async def test_restore_failure_on_one_of_three_leaves_no_restored_state(
    rf_servers: Own, tmp_path: Path
) -> None:
    fleet, engine = rf_servers.fleet, rf_servers.engine
    placed = {ref(f"rf-{n}_g0"): (INSTANCES[n % 3], {"seed": 40 + n, "turns": 8}) for n in range(6)}
    running = [
        asyncio.create_task(fleet.run_episode(name, RunEpisode(episode=ep, task=task)))
        for ep, (name, task) in placed.items()
    ]
    checkpoint, _, dataplane, staged, scope = await checkpoint_mid_run(
        fleet, engine, "rf-ck", {ep.rollout_id for ep in placed}
    )
    commit_root = tmp_path / "commit"
    await fleet.commit_all(checkpoint, scope, commit_root)
    # The checkpoint is taken: the originals go on and finish as attempt 0.
    await fleet.resume_all(checkpoint)
    await engine.release(list(staged.staged))
    for result in await bounded(asyncio.gather(*running)):
        assert result.episode.attempt == 0 and not result.restored

    # One byte of w1's records flipped: its restore fails on the digest.
    (records,) = (commit_root / "w1" / "workplace").glob("records-*.jsonl")
    data = bytearray(records.read_bytes())
    data[len(data) // 2] ^= 0x01
    records.write_bytes(bytes(data))

    loaded = load_prefixes(dataplane, staged.staged)
    prefixes = {call: record.model_dump(mode="json") for call, record in loaded.items()}
    outcome = await fleet.restore_all(
        unique("rf-rs"), checkpoint, commit_root, scope, prefixes, time.time() + 20
    )
    assert not outcome.ok
    assert "w1" in outcome.errors and "sha256" in outcome.errors["w1"], outcome.errors
    assert set(outcome.errors) == {"w1"}, outcome.errors  # retire and resume went through
    every = [ep.next_attempt() for eps in scope.values() for ep in eps]
    assert sorted(outcome.restarts, key=str) == sorted(every, key=str)
    assert outcome.restored.get("w0") and outcome.restored.get("w2")  # they had restored

    for name in INSTANCES:
        status = await fleet._client(name).status()
        assert (status.phase, status.checkpoint_id) == ("idle", None), status
    for name, eps in scope.items():
        for ep in eps:
            run = RunEpisode(episode=ep.next_attempt(), task=placed[ep][1])
            with pytest.raises(EnvRefused) as refused:
                await fleet.run_episode(name, run, max_wait_s=5)
            assert refused.value.reason == "retired", (name, ep, refused.value)

    # Forgotten, the n + 1 attempt runs from its input: no record of it was kept anywhere.
    ep = scope["w0"][0]
    assert await fleet.forget_all({"w0": [ep.next_attempt()]}) == {"w0": 1}
    run = RunEpisode(episode=ep.next_attempt(), task=placed[ep][1])
    fresh = await bounded(fleet.run_episode("w0", run))
    assert not fresh.restored and fresh.turns == 8
    assert all(h["call_id"].startswith(f"{ep.next_attempt().key}/") for h in fresh.info["history"])


# -- 3. a parked run is re-sent ------------------------------------------------------------------


class Recording(httpx.AsyncBaseTransport):
    """A real transport that notes every request (method, path, body) and its status."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.seen: list[tuple[str, str, bytes, int, bytes]] = []
        self.changed = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        response = await self.inner.handle_async_request(request)
        reply = await response.aread() if response.status_code != 200 else b""
        self.seen.append((request.method, request.url.path, body, response.status_code, reply))
        self.changed.set()
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()

    def runs(self) -> list[tuple[bytes, int, bytes]]:
        return [(b, s, r) for _, path, b, s, r in self.seen if path == EPISODES_RUN]

    def polls(self) -> list[int]:
        """The status code of every status poll."""
        return [s for m, p, _, s, _ in self.seen if p == f"{PREFIX}/status" and m == "GET"]


async def test_parked_episode_is_resent_after_resume_with_the_same_identity(
    trio: Trio, fleet: EnvFleet
) -> None:
    recording = Recording()
    checkpoint = unique("ps-ck")
    async with EnvFleet({"w0": trio.client("w0", transport=recording)}) as one:
        control = one._client("w0")
        prepared = await control.prepare(
            PrepareRequest(checkpoint_id=checkpoint, deadline_ts=time.time() + 20)
        )
        assert prepared.ready
        run = RunEpisode(episode=ref("ps-0_g0"), task={"seed": 3, "turns": 3})
        started = asyncio.create_task(one.run_episode("w0", run, parked_retry_s=0.1))
        while not recording.runs():  # its first try is refused
            recording.changed.clear()
            await bounded(recording.changed.wait(), 10)
        # It waits on status (from parked_retry_s on, backing off) and re-sends nothing
        # meanwhile: watched over two polls that found the instance still parked.
        await eventually_async(lambda: len(recording.polls()) >= 2, what="two status polls")
        assert not started.done() and len(recording.runs()) == 1  # waits, re-sends nothing
        await control.resume(ResumeRequest(checkpoint_id=checkpoint))
        result = await bounded(started)

    assert result.episode == run.episode and not result.restored  # no attempt spent
    assert result.turns == 3
    (first, status1, reply1), (second, status2, _) = recording.runs()
    assert (status1, status2) == (409, 200)
    assert b'"checkpoint_parked"' in reply1
    assert first == second == run.model_dump_json().encode()  # the identical body, re-sent
    polls = recording.polls()
    assert polls and all(s == 200 for s in polls)  # it waited on status, not on blind retries


# -- 4. the lease --------------------------------------------------------------------------------


async def test_lease_reopens_a_parked_instance_nobody_resumes(trio: Trio, fleet: EnvFleet) -> None:
    async with trio.client("w1") as client:
        run = RunEpisode(episode=ref("ls-0_g0"), task={"seed": 9, "turns": 16})
        episode = asyncio.create_task(client.run_episode(run))

        async def live() -> bool:
            assert not episode.done(), "the episode ended before it was seen running"
            return (await client.status()).live_episodes >= 1

        await eventually_async(live, 10, what="the episode running on w1")
        checkpoint = unique("ls-ck")
        prepared = await client.prepare(
            PrepareRequest(checkpoint_id=checkpoint, deadline_ts=time.time() + 1.0)
        )
        assert prepared.ready and [p.episode for p in prepared.parked] == [run.episode]
        # Nobody resumes and nobody asks: the instance's own lease watcher lets the parked
        # episode go at deadline + grace, and it finishes. The lease running out by itself is
        # what is under test: waited for through its effect (the episode's end), bounded.
        result = await bounded(episode, 10)
        ended = time.time()
        assert result.episode == run.episode and result.turns == 16
        assert ended >= prepared.lease_expires_ts - 0.05, "it ran on while parked"
        assert ended - prepared.lease_expires_ts < 8

        status = await client.status()
        assert (status.phase, status.checkpoint_id, status.lease_expires_ts) == ("idle", None, None)
        for call in (
            client.prepare(PrepareRequest(checkpoint_id=checkpoint, deadline_ts=time.time() + 5)),
            client.renew(RenewRequest(checkpoint_id=checkpoint, deadline_ts=time.time() + 5)),
        ):
            with pytest.raises(EnvRefused) as refused:
                await call
            assert refused.value.reason == "checkpoint_resumed"
        late = await client.resume(ResumeRequest(checkpoint_id=checkpoint))
        assert (late.phase, late.resumed) == ("idle", False)


# -- 5. retire / forget, and a resumed id --------------------------------------------------------


async def test_retired_rollout_refused_until_forget_and_resumed_id_refused_forever(
    trio: Trio, fleet: EnvFleet, tmp_path: Path
) -> None:
    ep = ref("rt-0_g0")
    run = RunEpisode(episode=ep, task={"seed": 2, "turns": 2})
    assert await fleet.retire_all({"w2": [ep]}) == {"w2": 1}
    assert await fleet.retire_all({"w2": [ep]}) == {"w2": 0}  # marked once
    for _ in range(2):  # refused every time, not once
        with pytest.raises(EnvRefused) as refused:
            await fleet.run_episode("w2", run, max_wait_s=5)
        assert refused.value.reason == "retired"
    other = await bounded(fleet.run_episode("w2", RunEpisode(episode=ep.next_attempt())))
    assert other.episode == ep.next_attempt()  # only that attempt is retired
    assert await fleet.forget_all({"w2": [ep]}) == {"w2": 1}
    result = await bounded(fleet.run_episode("w2", run))
    assert result.episode == ep and result.turns == 2

    async with trio.client("w2") as client:
        checkpoint = unique("rt-ck")
        prepare = PrepareRequest(checkpoint_id=checkpoint, deadline_ts=time.time() + 20)
        assert (await client.prepare(prepare)).ready
        assert (await client.prepare(prepare)).ready  # replayed while open
        first = await client.resume(ResumeRequest(checkpoint_id=checkpoint))
        again = await client.resume(ResumeRequest(checkpoint_id=checkpoint))
        assert first == again and first.resumed  # a resume replays, idempotently
        later = time.time() + 20
        calls = {
            "prepare": client.prepare(PrepareRequest(checkpoint_id=checkpoint, deadline_ts=later)),
            "renew": client.renew(RenewRequest(checkpoint_id=checkpoint, deadline_ts=later)),
            "commit": client.commit(
                CommitRequest(checkpoint_id=checkpoint, scope=(), dest=str(tmp_path))
            ),
            "restore": client.restore(
                RestoreRequest(
                    restore_id=checkpoint,
                    source_checkpoint_id=checkpoint,
                    root=str(tmp_path),
                    scope=(),
                    deadline_ts=later,
                )
            ),
        }
        for op, call in calls.items():
            with pytest.raises(EnvRefused) as refused:
                await call
            assert refused.value.reason == "checkpoint_resumed", op
        # Not stuck: a new id opens and closes as usual.
        fresh = unique("rt-ck")
        await client.prepare(PrepareRequest(checkpoint_id=fresh, deadline_ts=later))
        assert (await client.resume(ResumeRequest(checkpoint_id=fresh))).resumed
