"""The workplace environment against a real engine.

In process (a TorchEngine and a scripted session): an episode exported mid-generation and
restored continues the cut call from its prefix record, regenerating none of its tokens, and
ends exactly where the uninterrupted episode ends; the same at a boundary, and without a prefix.

Over HTTP: a real ``rollsafe engine serve`` and a real ``rollsafe env serve workplace`` process
run episodes deterministically, refuse a bad task with 422, and take fault switches.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from rollsafe.engine.http import EngineClient
from rollsafe.engine.loop import HOLD_ENV, HoldRule
from rollsafe.engine.model import ModelConfig
from rollsafe.engine.protocol import (
    CUT_BATCH,
    Completion,
    CutReport,
    EngineInfo,
    GenerateRequest,
    PrefixRecord,
    StreamEvent,
    TokenEvent,
)
from rollsafe.engine.torch_engine import TorchEngine
from rollsafe.env.hooks import Apply, OnTokens
from rollsafe.env.participant import Participant
from rollsafe.env.protocol import (
    EPISODES_RUN,
    PREFIX,
    CommitRequest,
    EpisodeRef,
    EpisodeResult,
    PrepareReply,
    PrepareRequest,
    RestoreRequest,
    ResumeRequest,
    RunEpisode,
    StatusReply,
)
from rollsafe.env.session import complete_call, take_prefix, turn_request
from rollsafe.errors import EngineUnavailable, InvalidInput
from rollsafe.http.served import ENGINE_BANNER, ENV_BANNER, ServedProcess, start_served
from rollsafe.reference.envs.workplace.env import WorkplaceEnv
from rollsafe.reference.envs.workplace.faults import EXIT_CODE, FaultSwitches
from rollsafe.testing.waiting import eventually_async

ROLLOUT = "wp-7_g0"
TASK = {"seed": 5, "meetings": 3, "turns": 4}
CUT_TURN = 2  # the turn whose call is cut
CUT_AT = 4  # tokens generated before the cut


class _Stop(Exception):
    """Ends a scripted episode where the checkpoint took it."""


class Session:
    """A scripted EpisodeSession: exports the episode at boundary ``park_at`` and stops. Its
    model calls are the toolkit's own (``turn_request``, ``complete_call``)."""

    def __init__(
        self,
        env: WorkplaceEnv,
        episode: EpisodeRef,
        restored: dict[str, Any] | None = None,
        park_at: int | None = None,
        prefixes: dict[str, PrefixRecord] | None = None,
    ) -> None:
        self.env, self.episode, self.restored, self.park_at = env, episode, restored, park_at
        self.prefixes: Mapping[str, PrefixRecord] = dict(prefixes or {})
        self._unused = dict(self.prefixes)
        self.resumed: dict[str, int] = {}
        self.boundaries: list[int] = []
        self.calls: list[str] = []
        self.exported: dict[str, Any] | None = None

    def request(self, turn: int, prompt_tokens: Sequence[int], **sampling: Any) -> GenerateRequest:
        return turn_request(self.episode, turn, prompt_tokens, **sampling)

    async def complete(
        self, engine: Any, request: GenerateRequest, *, on_tokens: OnTokens | None = None
    ) -> Completion:
        prefix = take_prefix(request, self._unused)
        if prefix is not None:
            self.resumed[prefix.call_id] = len(prefix.tokens)
        return await complete_call(engine, request, prefix, self.generating, on_tokens)

    def resumed_tokens(self, completion: Completion) -> int:
        return self.resumed.get(completion.call_id, 0)

    async def boundary(self, turn: int) -> None:
        self.boundaries.append(turn)
        if turn == self.park_at:
            self.exported = self.env.export_episode(self.episode)
            raise _Stop

    @asynccontextmanager
    async def generating(self, call_id: str) -> AsyncIterator[None]:
        self.calls.append(call_id)
        yield

    @contextmanager
    def tool(self) -> Iterator[None]:
        yield

    async def effect(self, turn: int, name: str, apply: Apply, *, args: Any = None) -> Any:
        raise AssertionError("the workplace environment applies no effects")


class CuttingEngine:
    """The engine, counting generate/resume per call; cuts ``cut_call`` after ``CUT_AT``
    tokens and then hangs its stream, as a parked episode's call hangs."""

    def __init__(self, inner: TorchEngine, cut_call: str | None = None) -> None:
        self.inner, self.cut_call = inner, cut_call
        self.generated: list[str] = []
        self.resumed: list[str] = []
        self.cut_report: CutReport | None = None
        self.parked = asyncio.Event()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        self.generated.append(request.call_id)
        stream = self.inner.generate(request)
        try:
            async for event in stream:
                yield event
                cut_now = isinstance(event, TokenEvent) and event.index + 1 == CUT_AT
                if request.call_id == self.cut_call and cut_now:
                    self.cut_report = await self.inner.cut([request.call_id])
                    self.parked.set()
                    await asyncio.Event().wait()  # frozen until the test cancels the episode
        finally:
            # Closed now: a cancelled episode frees its engine call before the test resumes it
            # (an orphaned stream's late cleanup would drop the resumed call of the same id).
            await getattr(stream, "aclose")()  # noqa: B009 - AsyncIterator does not declare it

    def resume(self, request: GenerateRequest, prefix: PrefixRecord) -> AsyncIterator[StreamEvent]:
        self.resumed.append(request.call_id)
        return self.inner.resume(request, prefix)

    async def cut(self, call_ids: Sequence[str], *, batch_size: int = CUT_BATCH) -> CutReport:
        return await self.inner.cut(call_ids, batch_size=batch_size)

    async def release(self, call_ids: Sequence[str]) -> int:
        return await self.inner.release(call_ids)

    async def info(self) -> EngineInfo:
        return await self.inner.info()


@pytest.fixture
async def torch_engine() -> AsyncIterator[TorchEngine]:
    async with TorchEngine(ModelConfig(kind="dense"), 1) as engine:
        yield engine


@pytest.fixture
async def holding_engine(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TorchEngine]:
    """The same engine, holding turn ``CUT_TURN``'s call once it made ``CUT_AT`` tokens until
    the cut: the cut finds it mid-call however loaded the machine is (else a fast decode may
    finish the call before the cut, and no prefix is staged)."""
    rule = HoldRule(calls=re.escape(f"{ROLLOUT}/t{CUT_TURN}") + "$", after_tokens=CUT_AT)
    monkeypatch.setenv(HOLD_ENV, rule.model_dump_json())
    engine = TorchEngine(ModelConfig(kind="dense"), 1)  # reads the rule as it is made
    monkeypatch.delenv(HOLD_ENV)  # no other engine of the test holds
    async with engine:
        yield engine


def ref(attempt: int = 0) -> EpisodeRef:
    return EpisodeRef(rollout_id=ROLLOUT, attempt=attempt)


async def uninterrupted(engine: TorchEngine) -> EpisodeResult:
    env = WorkplaceEnv(CuttingEngine(engine))
    return await env.run_episode(RunEpisode(episode=ref(), task=TASK), Session(env, ref()))


async def park_mid_call(
    torch_engine: TorchEngine, turn: int
) -> tuple[CuttingEngine, dict[str, Any]]:
    """Run the episode until turn ``turn``'s call is cut; export it there (what a commit
    does), then abandon the attempt (its instance is gone)."""
    engine = CuttingEngine(torch_engine, f"{ROLLOUT}/t{turn}")
    env = WorkplaceEnv(engine)
    task = asyncio.create_task(
        env.run_episode(RunEpisode(episode=ref(), task=TASK), Session(env, ref()))
    )
    await asyncio.wait_for(engine.parked.wait(), 10)
    record = env.export_episode(ref())
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    with pytest.raises(InvalidInput, match="no live episode"):
        env.export_episode(ref())  # the cancelled run let go of its state
    return engine, record


def same_play(a: EpisodeResult, b: EpisodeResult) -> None:
    """Same tokens every turn, same actions, same calendar, same reward; call ids may differ."""
    assert [h["tokens"] for h in a.info["history"]] == [h["tokens"] for h in b.info["history"]]
    strip = [{k: v for k, v in m.items() if k != "call_id"} for m in a.info["mutations"]]
    assert strip == [{k: v for k, v in m.items() if k != "call_id"} for m in b.info["mutations"]]
    assert (a.info["calendar"], a.reward, a.turns) == (b.info["calendar"], b.reward, b.turns)


async def test_cut_call_resumes_from_its_prefix_without_regenerating(
    torch_engine: TorchEngine, holding_engine: TorchEngine
) -> None:
    whole = await uninterrupted(torch_engine)
    cut_call = f"{ROLLOUT}/t{CUT_TURN}"
    engine, record = await park_mid_call(holding_engine, CUT_TURN)
    assert record["turn"] == CUT_TURN and record["in_flight"]["call_id"] == cut_call
    assert engine.cut_report is not None
    (prefix,) = engine.cut_report.prefixes
    assert len(prefix.tokens) == CUT_AT  # held there until the cut

    second = WorkplaceEnv(engine)  # another instance: only the record and the prefix travel
    second.restore_episode(ref(), record)
    session = Session(second, ref(1), restored=record, prefixes={cut_call: prefix})
    result = await second.run_episode(RunEpisode(episode=ref(1), task=TASK), session)

    assert engine.resumed == [cut_call]
    assert engine.generated.count(cut_call) == 1  # the original call only
    assert session.calls == [cut_call, f"{ROLLOUT}-a1/t3"]
    assert result.info["attempt"]["resumed_from"] == {cut_call: len(prefix.tokens)}
    same_play(result, whole)


async def test_restore_at_a_boundary_and_without_a_prefix(torch_engine: TorchEngine) -> None:
    whole = await uninterrupted(torch_engine)
    env = WorkplaceEnv(torch_engine)
    parked = Session(env, ref(), park_at=CUT_TURN)
    with pytest.raises(_Stop):
        await env.run_episode(RunEpisode(episode=ref(), task=TASK), parked)
    assert parked.exported is not None and parked.exported["in_flight"] is None
    env.restore_episode(ref(), parked.exported)
    session = Session(env, ref(1), restored=parked.exported)
    result = await env.run_episode(RunEpisode(episode=ref(1), task=TASK), session)
    assert session.boundaries == [CUT_TURN, 3, 4]
    same_play(result, whole)

    # In flight, no prefix (the cut refused it): generated again under this attempt's id.
    _, record = await park_mid_call(torch_engine, CUT_TURN)
    again = WorkplaceEnv(torch_engine)
    again.restore_episode(ref(), record)
    session = Session(again, ref(1), restored=record)
    result = await again.run_episode(RunEpisode(episode=ref(1), task=TASK), session)
    assert session.calls[0] == f"{ROLLOUT}-a1/t{CUT_TURN}"
    assert result.info["attempt"]["resumed_from"] == {}
    same_play(result, whole)


async def test_restore_refuses_bad_records(torch_engine: TorchEngine) -> None:
    """(A staged prefix that does not verify is refused by the toolkit itself, before the
    environment sees the record: tests/unit/test_env_participant.py.)"""
    _, record = await park_mid_call(torch_engine, 1)
    env = WorkplaceEnv(torch_engine)
    bad_cases: list[tuple[EpisodeRef, dict[str, Any], str]] = [
        (ref(), {**record, "turn": 3}, "bad workplace record"),
        (ref(), {**record, "colour": 1}, "bad workplace record"),
        (ref(1), record, "not"),
    ]
    for episode, bad, match in bad_cases:
        with pytest.raises(InvalidInput, match=match):
            env.restore_episode(episode, bad)
    env.drop_episode(ref(1))  # nothing held: a no-op


class SwitchedEngine(CuttingEngine):
    """The engine behind a switch: while off, every call fails as an engine that is down;
    ``hold_call``'s stream waits (generating) until the test cancels the episode."""

    def __init__(self, inner: TorchEngine, hold_call: str) -> None:
        super().__init__(inner)
        self.on, self.hold_call = True, hold_call

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        if not self.on:
            raise EngineUnavailable("engine is down")
        if request.call_id == self.hold_call:
            self.parked.set()
            await asyncio.Event().wait()
        async for event in super().generate(request):
            yield event


async def test_a_restored_attempt_retried_after_a_503_continues_its_record(
    torch_engine: TorchEngine, tmp_path: Path
) -> None:
    """The issue's reproduction, on the toolkit: park at turn 2, commit, restore on another
    instance, run attempt n + 1 while the engine is down (503), bring it up, retry. The
    retry continues the record: turns 0-1 are the record's, never applied again."""
    engine = SwitchedEngine(torch_engine, hold_call=f"{ROLLOUT}/t{CUT_TURN}")
    first = Participant("wp-a", WorkplaceEnv(engine))
    run = asyncio.ensure_future(first.run(RunEpisode(episode=ref(), task=TASK)))
    await asyncio.wait_for(engine.parked.wait(), 10)
    (parked,) = (await first.prepare(PrepareRequest(checkpoint_id="ck", deadline_ts=soon()))).parked
    assert (parked.turn, parked.activity) == (CUT_TURN, "generating")
    dest = tmp_path / "ck"
    await first.commit(CommitRequest(checkpoint_id="ck", scope=(ref(),), dest=str(dest)))
    run.cancel()  # the instance is lost
    await asyncio.gather(run, return_exceptions=True)

    second = Participant("wp-b", WorkplaceEnv(engine))
    source = {"source_checkpoint_id": "ck", "root": str(dest), "scope": (ref(),)}
    await second.restore(RestoreRequest(restore_id="r", deadline_ts=soon(), **source))
    await second.resume(ResumeRequest(checkpoint_id="r"))
    engine.on = False
    with pytest.raises(EngineUnavailable):
        await second.run(RunEpisode(episode=ref(1), task=TASK))
    engine.on, engine.hold_call = True, ""
    result = await second.run(RunEpisode(episode=ref(1), task=TASK))

    assert result.restored and result.restored_at_turn == CUT_TURN + 1
    calls = [m["call_id"] for m in result.info["mutations"]]
    assert calls == [f"{ROLLOUT}/t0", f"{ROLLOUT}/t1", f"{ROLLOUT}-a1/t2", f"{ROLLOUT}-a1/t3"]
    same_play(result, await uninterrupted(torch_engine))


def soon(seconds: float = 30.0) -> float:
    return time.time() + seconds


# -- over HTTP: real server processes -----------------------------------------------------------

ENGINE_TOKEN = "wp-engine-token"
ENV_TOKEN = "wp-env-token"
INSTANCE = "wp-test"
WORKPLACE_BANNER = ENV_BANNER.format(name="workplace", instance=INSTANCE)
AUTH = {"authorization": f"Bearer {ENV_TOKEN}"}
STATUS = f"{PREFIX}/status"


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    args = ["engine", "serve", "--port", "0", "--model", "dense", "--seed", "1"]
    banner = ENGINE_BANNER.format(kind="dense")
    logs = tmp_path_factory.mktemp("engine")
    server = start_served(args, banner, logs, {"ROLLSAFE_ENGINE_TOKEN": ENGINE_TOKEN})
    try:
        yield server
    finally:
        server.stop()


def start_env(engine: ServedProcess, logs: Path, **env: str) -> ServedProcess:
    args = ["env", "serve", "workplace", "--port", "0", "--instance", INSTANCE]
    args += ["--engine-url", engine.url, "--lease-grace-s", "0.5"]
    return start_served(
        args, WORKPLACE_BANNER, logs, {"ROLLSAFE_ENGINE_TOKEN": ENGINE_TOKEN, **env}
    )


@pytest.fixture(scope="module")
def env_server(
    engine_server: ServedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServedProcess]:
    logs = tmp_path_factory.mktemp("env")
    server = start_env(engine_server, logs, ROLLSAFE_ENV_TOKEN=ENV_TOKEN)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def env_http(env_server: ServedProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=env_server.url, headers=AUTH, timeout=30) as http:
        yield http
        await http.post("/faults", json={})  # every switch off for the next test


async def run_http(
    http: httpx.AsyncClient, episode: EpisodeRef, task: dict[str, Any]
) -> EpisodeResult:
    body = RunEpisode(episode=episode, task=task).model_dump(mode="json")
    reply = await http.post(EPISODES_RUN, json=body)
    assert reply.status_code == 200, reply.text
    return EpisodeResult.model_validate_json(reply.content)


async def test_episodes_over_http_are_deterministic(
    env_http: httpx.AsyncClient, torch_engine: TorchEngine
) -> None:
    tasks = {f"wp-{i}_g0": {"seed": i, "meetings": 1 + i, "turns": 3 + i} for i in range(3)}

    async def all_episodes() -> list[EpisodeResult]:
        runs = (
            run_http(env_http, EpisodeRef(rollout_id=r, attempt=0), t) for r, t in tasks.items()
        )
        return list(await asyncio.gather(*runs))

    first, second = await all_episodes(), await all_episodes()
    assert [r.model_dump() for r in first] == [r.model_dump() for r in second]
    for result, task in zip(first, tasks.values(), strict=True):
        assert 0.0 <= result.reward <= 1.0 and not result.restored
        assert [m["turn"] for m in result.info["mutations"]] == list(range(task["turns"]))
    # Another process, same engine seed: the in-process engine plays the same episode.
    same_play(await run_http(env_http, ref(), TASK), await uninterrupted(torch_engine))


async def test_bad_task_is_422_and_a_bad_token_401(env_http: httpx.AsyncClient) -> None:
    for task in ({"turns": 0}, {"colour": "red"}, {"seed": "x"}):
        body = RunEpisode(episode=ref(), task=task).model_dump(mode="json")
        reply = await env_http.post(EPISODES_RUN, json=body)
        assert reply.status_code == 422, reply.text
        assert "bad workplace task" in reply.json()["detail"]
    bad = {"authorization": "Bearer nope"}
    assert (await env_http.get(STATUS, headers=bad)).status_code == 401
    assert (await env_http.post("/faults", json={}, headers=bad)).status_code == 401


async def set_faults(http: httpx.AsyncClient, **switches: Any) -> None:
    reply = await http.post("/faults", json=switches)
    assert reply.status_code == 200 and reply.json() == FaultSwitches(**switches).model_dump()


async def control(http: httpx.AsyncClient, op: str, body: BaseModel) -> dict[str, Any]:
    reply = await http.post(f"{PREFIX}/{op}", content=body.model_dump_json())
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


async def test_checkpoint_mid_generation_restores_over_http(
    env_http: httpx.AsyncClient, engine_server: ServedProcess, tmp_path: Path
) -> None:
    episode, task = EpisodeRef(rollout_id="wp-ck-0_g0", attempt=0), {"seed": 3, "turns": 16}
    calls = [f"{episode.key}/t{turn}" for turn in range(16)]
    running = asyncio.create_task(run_http(env_http, episode, task))
    async with EngineClient(engine_server.url, ENGINE_TOKEN) as engine:
        # Freeze whichever call the episode is making, so it is surely parked generating.
        async def one_cut() -> CutReport | None:
            assert not running.done(), "the episode ended before a call of it was cut"
            cut = await engine.cut(calls)
            return cut if cut.prefixes else None

        cut: CutReport | None = await eventually_async(
            one_cut, 10, what="a call of the episode cut mid-generation"
        )
        assert cut is not None
        (prefix,) = cut.prefixes
        prepared = await control(
            env_http,
            "prepare",
            PrepareRequest(checkpoint_id="wp-ck-1", deadline_ts=time.time() + 5),
        )
        (parked,) = PrepareReply.model_validate(prepared).parked
        assert (parked.activity, parked.model_call_id) == ("generating", prefix.call_id)
        commit = CommitRequest(checkpoint_id="wp-ck-1", scope=(episode,), dest=str(tmp_path))
        (manifest,) = (await control(env_http, "commit", commit))["participants"]
        (line,) = (tmp_path / manifest["file"]).read_text().splitlines()
        state = json.loads(line)["state"]
        assert (state["format"], state["turn"]) == ("workplace/1", parked.turn)
        assert state["in_flight"]["request"]["call_id"] == prefix.call_id
        await engine.release([prefix.call_id])
    await control(env_http, "resume", ResumeRequest(checkpoint_id="wp-ck-1"))
    original = await running

    restore = RestoreRequest(
        restore_id="wp-ck-r1",
        source_checkpoint_id="wp-ck-1",
        root=str(tmp_path),
        scope=(episode,),
        prefixes={prefix.call_id: prefix.model_dump(mode="json")},
        deadline_ts=time.time() + 5,
    )
    assert (await control(env_http, "restore", restore))["restored"][0]["attempt"] == 1
    await control(env_http, "resume", ResumeRequest(checkpoint_id="wp-ck-r1"))
    restored = await run_http(env_http, episode.next_attempt(), task)
    assert restored.restored and not original.restored
    assert restored.info["attempt"]["resumed_from"] == {prefix.call_id: len(prefix.tokens)}
    assert restored.info["mutations"][parked.turn]["call_id"] == prefix.call_id
    same_play(restored, original)


async def test_fault_switches_at_runtime(env_http: httpx.AsyncClient) -> None:
    await set_faults(env_http, unavailable=True)
    reply = await env_http.get(STATUS)
    assert reply.status_code == 503 and reply.json()["error"] == "EnvUnavailable"

    await set_faults(env_http, slow_prepare=0.2, lose_resume=True)
    began = time.monotonic()
    prepare = PrepareRequest(checkpoint_id="wp-lost-1", deadline_ts=time.time() + 0.4)
    await control(env_http, "prepare", prepare)
    assert time.monotonic() - began >= 0.2
    lost = await control(env_http, "resume", ResumeRequest(checkpoint_id="wp-lost-1"))
    assert lost == {"phase": "idle", "resumed": True}
    status = StatusReply.model_validate_json((await env_http.get(STATUS)).content)
    assert (status.phase, status.checkpoint_id) == ("prepared", "wp-lost-1")  # not applied

    await set_faults(env_http, stale_checkpoint=True)
    status = StatusReply.model_validate_json((await env_http.get(STATUS)).content)
    assert status.checkpoint_id not in (None, "wp-lost-1")  # an older id than its own

    await set_faults(env_http)  # the lease (deadline + 0.5 s grace here) resumes the instance

    async def idle() -> bool:
        return bool((await env_http.get(STATUS)).json()["phase"] == "idle")

    await eventually_async(idle, 5, what="the instance idle again once its lease ran out")
    assert (await env_http.post("/faults", json={"die_on": "nope"})).status_code == 422


def test_dying_instance_from_the_environment_variable(
    engine_server: ServedProcess, tmp_path: Path
) -> None:
    env = {"ROLLSAFE_ENV_TOKEN": ENV_TOKEN, "ROLLSAFE_ENV_FAULTS": "die_on:prepare"}
    server = start_env(engine_server, tmp_path, **env)
    try:
        assert httpx.get(f"{server.url}{STATUS}", headers=AUTH).status_code == 200
        prepare = PrepareRequest(checkpoint_id="wp-die-1", deadline_ts=time.time() + 5)
        with pytest.raises(httpx.TransportError):
            httpx.post(
                f"{server.url}{PREFIX}/prepare", content=prepare.model_dump_json(), headers=AUTH
            )
        assert server.proc.wait(timeout=10) == EXIT_CODE
    finally:
        server.stop()
