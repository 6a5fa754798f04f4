"""EnvClient and EnvFleet against scripted fake instances (httpx.MockTransport, no server)."""

from __future__ import annotations

import asyncio
import json
import pickle
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from rollsafe.env.client import EnvClient
from rollsafe.env.fleet import EnvFleet
from rollsafe.env.fleet_rules import place
from rollsafe.env.protocol import (
    CommitReply,
    CommitRequest,
    CountReply,
    EpisodeRef,
    EpisodeResult,
    ErrorReply,
    LeaseReply,
    ParkedEpisode,
    ParticipantManifest,
    PrepareReply,
    PrepareRequest,
    RenewReply,
    RenewRequest,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    RetireRequest,
    RunEpisode,
    RunLease,
    StatusReply,
)
from rollsafe.errors import (
    EnvNotReady,
    EnvRefused,
    EnvUnavailable,
    EpisodeParked,
    InvalidInput,
    OwnershipMismatch,
    SchemaMismatch,
    TopologyMismatch,
)
from rollsafe.testing.waiting import eventually_async

TOKEN = "run-token"
Fault = Callable[[httpx.Request], Awaitable[httpx.Response | None]]


def ref(n: int, attempt: int = 0) -> EpisodeRef:
    return EpisodeRef(rollout_id=f"run-{n}_g0", attempt=attempt)


def _json(model: BaseModel, status: int = 200) -> httpx.Response:
    return httpx.Response(status, content=model.model_dump_json(), headers=_CT)


_CT = {"content-type": "application/json"}


def refuse(status: int, error: str, detail: str = "") -> Fault:
    async def fault(request: httpx.Request) -> httpx.Response:
        return _json(ErrorReply(error=error, detail=detail), status)

    return fault


def unreachable() -> Fault:
    async def fault(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    return fault


def slow(seconds: float) -> Fault:
    async def fault(request: httpx.Request) -> None:
        await asyncio.sleep(seconds)  # then the normal reply

    return fault


def raw(content: bytes) -> Fault:
    async def fault(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=content, headers=_CT)

    return fault


class FakeInstance:
    """The protocol's replies for one instance, with scripted faults per operation."""

    def __init__(
        self,
        name: str,
        *,
        parked: tuple[ParkedEpisode, ...] = (),
        restarts: tuple[EpisodeRef, ...] = (),
        blockers: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.phase = "idle"
        self.checkpoint_id: str | None = None
        self.parked = parked
        self.restarts = restarts
        self.blockers = blockers
        self.extra_export: tuple[EpisodeRef, ...] = ()
        self.manifest_instance = name
        self.idle_after_polls: int | None = None
        self.faults: dict[str, Fault] = {}
        self.calls: list[tuple[str, Any]] = []

    def bodies(self, op: str) -> list[Any]:
        return [body for name, body in self.calls if name == op]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        op = request.url.path.rsplit("/", 1)[-1]
        body = json.loads(request.content) if request.content else None
        self.calls.append((op, body))
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return _json(ErrorReply(error="unauthorized", detail="wrong bearer token"), 401)
        if op in self.faults:
            response = await self.faults[op](request)
            if response is not None:
                return response
        reply: BaseModel = getattr(self, f"_{op}")(body)
        return _json(reply, 409 if isinstance(reply, ErrorReply) else 200)

    def _status(self, body: None) -> StatusReply:
        if self.idle_after_polls is not None:
            self.idle_after_polls -= 1
            if self.idle_after_polls <= 0:
                self.phase = "idle"
        return StatusReply(
            instance=self.name,
            phase=self.phase,
            checkpoint_id=self.checkpoint_id,
            live_episodes=len(self.parked),
            retired=0,
            participants=("environment",),
        )

    def _prepare(self, body: Any) -> PrepareReply:
        request = PrepareRequest.model_validate(body)
        if not self.blockers:
            self.phase, self.checkpoint_id = "prepared", request.checkpoint_id
        return PrepareReply(
            ready=not self.blockers,
            blockers=self.blockers,
            parked=self.parked,
            restarts=self.restarts,
            lease_expires_ts=request.deadline_ts + 1,
        )

    def _renew(self, body: Any) -> RenewReply:
        return RenewReply(lease_expires_ts=RenewRequest.model_validate(body).deadline_ts + 1)

    def _commit(self, body: Any) -> CommitReply:
        request = CommitRequest.model_validate(body)
        manifest = ParticipantManifest(
            name="environment",
            kind="environment",
            instance=self.manifest_instance,
            checkpoint_id=request.checkpoint_id,
            file="environment/records.jsonl",
            sha256="0" * 64,
            records=len(request.scope),
        )
        committed = (*request.scope, *self.extra_export)
        return CommitReply(committed=committed, participants=(manifest,))

    def _resume(self, body: Any) -> ResumeReply:
        was_open, self.phase, self.checkpoint_id = self.phase != "idle", "idle", None
        return ResumeReply(phase="idle", resumed=was_open)

    def _retire(self, body: Any) -> CountReply:
        return CountReply(count=len(RetireRequest.model_validate(body).rollouts))

    def _restore(self, body: Any) -> RestoreReply:
        request = RestoreRequest.model_validate(body)
        self.phase = "restored"
        restored = tuple(r.next_attempt() for r in request.episodes)
        return RestoreReply(restored=restored, lease_expires_ts=request.deadline_ts + 1)

    def _lease(self, body: Any) -> LeaseReply:
        lease = RunLease.model_validate(body)
        return LeaseReply(holder=lease.holder, expires_ts=time.time() + lease.ttl_s)

    def _run(self, body: Any) -> BaseModel:
        run = RunEpisode.model_validate(body)
        if self.phase != "idle":
            return ErrorReply(error="checkpoint_parked", detail="parked for a checkpoint")
        return EpisodeResult(episode=run.episode, reward=1.0, turns=3, restored=False)


def client_for(fake: FakeInstance, token: str = TOKEN, **kw: Any) -> EnvClient:
    transport = httpx.MockTransport(fake.handle)
    return EnvClient(f"http://{fake.name}.test:8000", token, transport=transport, **kw)


def fleet_of(*fakes: FakeInstance) -> EnvFleet:
    return EnvFleet({fake.name: client_for(fake) for fake in fakes})


def parked(*refs: EpisodeRef) -> tuple[ParkedEpisode, ...]:
    return tuple(ParkedEpisode(episode=r, turn=2, activity="boundary") for r in refs)


def soon(seconds: float = 5.0) -> float:
    return time.time() + seconds


# -- EnvClient: error mapping ---------------------------------------------------------------------


async def test_401_is_invalid_input_about_the_token() -> None:
    async with client_for(FakeInstance("env-a"), token="stale") as client:
        with pytest.raises(InvalidInput, match="refused the token") as info:
            await client.status()
    assert not isinstance(info.value, EnvRefused)
    assert "env-a.test" in str(info.value)


async def test_409_checkpoint_parked_is_a_transient_episode_parked() -> None:
    fake = FakeInstance("env-a")
    fake.phase = "prepared"
    run = RunEpisode(episode=ref(1))
    async with client_for(fake) as client:
        with pytest.raises(EpisodeParked) as info:
            await client.run_episode(run)
    assert isinstance(info.value, EnvNotReady) and info.value.transient
    assert info.value.reason == "checkpoint_parked"
    assert "env-a.test" in str(info.value) and "run_episode" in str(info.value)


@pytest.mark.parametrize(
    "reason",
    ["retired", "wrong_phase", "other_checkpoint", "checkpoint_resumed", "already_running"],
)
async def test_other_409_reasons_are_env_refused(reason: str) -> None:
    fake = FakeInstance("env-a")
    fake.faults["commit"] = refuse(409, reason, "not now")
    request = CommitRequest(checkpoint_id="ck-1", scope=(ref(1),), dest="/tmp/x")
    async with client_for(fake) as client:
        with pytest.raises(EnvRefused) as info:
            await client.commit(request)
    assert info.value.reason == reason
    assert isinstance(info.value, InvalidInput) and not info.value.transient
    assert not isinstance(info.value, EpisodeParked)


async def test_422_is_invalid_input_naming_the_field() -> None:
    fake = FakeInstance("env-a")
    fake.faults["prepare"] = refuse(422, "invalid_body", "deadline_ts: must be > 0")
    async with client_for(fake) as client:
        with pytest.raises(InvalidInput, match="deadline_ts") as info:
            await client.prepare(PrepareRequest(checkpoint_id="ck-1", deadline_ts=soon()))
    assert not isinstance(info.value, EnvRefused)


async def test_503_is_env_unavailable_naming_url_and_op() -> None:
    fake = FakeInstance("env-a")
    fake.faults["renew"] = refuse(503, "EnvUnavailable", "shutting down")
    async with client_for(fake) as client:
        with pytest.raises(EnvUnavailable, match=r"env-a\.test.*renew.*shutting down"):
            await client.renew(RenewRequest(checkpoint_id="ck-1", deadline_ts=soon()))


async def test_connection_failure_is_env_unavailable() -> None:
    fake = FakeInstance("env-a")
    fake.faults["status"] = unreachable()
    async with client_for(fake) as client:
        with pytest.raises(EnvUnavailable, match=r"env-a\.test.*status unreachable"):
            await client.status()


async def test_a_reply_past_the_deadline_is_env_unavailable() -> None:
    fake = FakeInstance("env-a")
    fake.faults["status"] = slow(5.0)
    started = time.monotonic()
    async with client_for(fake, timeout_s=0.05, grace_s=0.05) as client:
        with pytest.raises(EnvUnavailable, match="no reply within"):
            await client.status()
    assert time.monotonic() - started < 1.0


async def test_prepare_waits_until_its_own_deadline_plus_grace() -> None:
    fake = FakeInstance("env-a")
    fake.faults["prepare"] = slow(0.3)
    async with client_for(fake, timeout_s=0.01, grace_s=0.05) as client:
        # The control timeout (0.06 s) would cut it off; the prepare deadline does not.
        reply = await client.prepare(PrepareRequest(checkpoint_id="ck-1", deadline_ts=soon(1)))
        assert reply.ready
        with pytest.raises(EnvUnavailable, match="prepare got no reply"):
            await client.prepare(PrepareRequest(checkpoint_id="ck-2", deadline_ts=soon(0.05)))


async def test_a_reply_that_does_not_validate_names_the_instance() -> None:
    fake = FakeInstance("env-a")
    fake.faults["prepare"] = raw(b'{"ready": "perhaps", "lease_expires_ts": 1.0}')
    async with client_for(fake) as client:
        with pytest.raises(SchemaMismatch, match=r"env-a\.test.*prepare.*PrepareReply"):
            await client.prepare(PrepareRequest(checkpoint_id="ck-1", deadline_ts=soon()))


def test_refusals_pickle_with_their_fields() -> None:
    error = EnvRefused("http://env-a.test", "commit", "retired", "episode run-1_g0")
    error.add_note("context")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is EnvRefused and str(copy) == str(error)
    assert (copy.reason, copy.op, copy.url) == ("retired", "commit", "http://env-a.test")
    assert copy.__notes__ == ["context"]


# -- EnvFleet: prepare all or resume all ----------------------------------------------------------


async def test_prepare_all_reports_each_instance_inventory() -> None:
    generating = ParkedEpisode(
        episode=ref(2), turn=4, activity="generating", model_call_id="call-7"
    )
    a = FakeInstance("env-a", parked=parked(ref(1)))
    b = FakeInstance("env-b", parked=(generating,), restarts=(ref(3),))
    async with fleet_of(a, b) as fleet:
        prepared = await fleet.prepare_all("ck-1", soon())
    assert prepared.instances["env-b"].parked == (generating,)
    assert prepared.instances["env-b"].restarts == (ref(3),)
    assert prepared.owners() == {"run-1_g0": "env-a", "run-2_g0": "env-b", "run-3_g0": "env-b"}
    assert not a.bodies("resume") and not b.bodies("resume")


async def test_prepare_all_one_not_ready_resumes_every_instance() -> None:
    fakes = [FakeInstance("env-a"), FakeInstance("env-b"), FakeInstance("env-c")]
    fakes[1].blockers = ("run-5_g0 inside a tool call",)
    async with fleet_of(*fakes) as fleet:
        with pytest.raises(EnvNotReady, match="1 of 3") as info:
            await fleet.prepare_all("ck-1", soon())
    message = str(info.value)
    assert "env-b" in message and "run-5_g0 inside a tool call" in message
    assert "env-a" not in message and "env-c" not in message
    for fake in fakes:
        assert fake.bodies("resume") == [{"checkpoint_id": "ck-1"}], fake.name


async def test_prepare_all_unreachable_instance_is_env_unavailable_and_resumes_all() -> None:
    fakes = [FakeInstance("env-a"), FakeInstance("env-b"), FakeInstance("env-c")]
    fakes[0].faults["prepare"] = unreachable()
    fakes[2].blockers = ("busy",)
    fakes[2].faults["resume"] = refuse(503, "EnvUnavailable", "down")
    async with fleet_of(*fakes) as fleet:
        with pytest.raises(EnvUnavailable) as info:
            await fleet.prepare_all("ck-1", soon())
    assert "env-a" in str(info.value) and "env-c" in str(info.value)
    assert any("resume on env-c failed" in note for note in info.value.__notes__)
    assert all(fake.bodies("resume") for fake in fakes)


async def test_prepare_all_rollout_on_two_instances_is_ownership_mismatch() -> None:
    a = FakeInstance("env-a", parked=parked(ref(1), ref(2)))
    b = FakeInstance("env-b", restarts=(ref(1, attempt=1),))
    async with fleet_of(a, b) as fleet:
        with pytest.raises(OwnershipMismatch, match=r"run-1_g0 on env-a and env-b") as info:
            await fleet.prepare_all("ck-1", soon())
    assert "run-2_g0" not in str(info.value)
    assert a.bodies("resume") and b.bodies("resume")


# -- EnvFleet: commit -----------------------------------------------------------------------------


async def test_commit_all_sends_only_the_scope_to_a_dest_per_instance(tmp_path: Any) -> None:
    a, b = FakeInstance("env-a"), FakeInstance("env-b")
    async with fleet_of(a, b) as fleet:
        done = await fleet.commit_all("ck-1", {"env-a": [ref(1), ref(2)]}, tmp_path)
    assert [EpisodeRef(**e) for e in a.bodies("commit")[0]["scope"]] == [ref(1), ref(2)]
    assert a.bodies("commit")[0]["dest"] == str(tmp_path / "env-a")
    assert b.bodies("commit") == [
        {"checkpoint_id": "ck-1", "scope": [], "dest": str(tmp_path / "env-b")}
    ]
    assert done.instances["env-a"].committed == (ref(1), ref(2))
    assert done.instances["env-a"].missing == ()


async def test_commit_reply_outside_the_scope_is_ownership_mismatch() -> None:
    a, b = FakeInstance("env-a"), FakeInstance("env-b")
    a.extra_export = (ref(9),)
    async with fleet_of(a, b) as fleet:
        with pytest.raises(OwnershipMismatch, match=r"env-a exported .*outside.*run-9_g0"):
            await fleet.commit_all("ck-1", {"env-a": [ref(1)], "env-b": [ref(2)]}, "/snap")


async def test_commit_participant_manifest_of_another_instance_is_ownership_mismatch() -> None:
    a = FakeInstance("env-a")
    a.manifest_instance = "env-z"
    async with fleet_of(a) as fleet:
        with pytest.raises(OwnershipMismatch, match="'env-z'"):
            await fleet.commit_all("ck-1", {"env-a": [ref(1)]}, "/snap")


async def test_commit_one_rollout_exported_by_two_instances_is_ownership_mismatch() -> None:
    a, b = FakeInstance("env-a"), FakeInstance("env-b")
    async with fleet_of(a, b) as fleet:
        with pytest.raises(OwnershipMismatch, match="more than one instance") as info:
            await fleet.commit_all("ck-1", {"env-a": [ref(1)], "env-b": [ref(1)]}, "/snap")
    assert "outside" not in str(info.value)


# -- EnvFleet: restore ----------------------------------------------------------------------------


async def test_restore_failure_on_one_of_three_retires_next_attempts_and_resumes_all() -> None:
    fakes = [FakeInstance(f"env-{x}") for x in "abc"]
    fakes[1].faults["restore"] = refuse(503, "EnvUnavailable", "disk gone")
    scope = {"env-a": [ref(1)], "env-b": [ref(2)], "env-c": [ref(3), ref(4)]}
    async with fleet_of(*fakes) as fleet:
        result = await fleet.restore_all("rs-1", "ck-1", "/snap/env", scope, {}, soon())
    assert not result.ok
    assert set(result.errors) == {"env-b"} and "disk gone" in result.errors["env-b"]
    assert set(result.restarts) == {ref(n, attempt=1) for n in (1, 2, 3, 4)}
    for fake in fakes:
        retired = [EpisodeRef(**e) for body in fake.bodies("retire") for e in body["rollouts"]]
        assert retired == [r.next_attempt() for r in scope[fake.name]], fake.name
        assert fake.bodies("resume") == [{"checkpoint_id": "rs-1"}], fake.name


async def test_restore_all_ok_keeps_instances_restored_until_resume() -> None:
    a, b = FakeInstance("env-a"), FakeInstance("env-b")
    async with fleet_of(a, b) as fleet:
        result = await fleet.restore_all(
            "rs-1", "ck-1", "/snap/env", {"env-a": [ref(1)]}, {"call-7": {"x": 1}}, soon()
        )
    assert result.ok and result.restarts == () and result.errors == {}
    assert result.restored == {"env-a": (ref(1, attempt=1),)}
    assert a.bodies("restore")[0]["root"] == "/snap/env/env-a"
    assert a.bodies("restore")[0]["prefixes"] == {"call-7": {"x": 1}}
    assert not b.bodies("restore")  # nothing to restore there
    assert not a.bodies("resume") and not a.bodies("retire")


async def test_restore_that_restores_only_part_of_the_scope_falls_back() -> None:
    a = FakeInstance("env-a")

    async def partial(request: httpx.Request) -> httpx.Response:
        deadline = json.loads(request.content)["deadline_ts"]
        return _json(RestoreReply(restored=(ref(1, 1),), lease_expires_ts=deadline))

    a.faults["restore"] = partial
    async with fleet_of(a) as fleet:
        result = await fleet.restore_all(
            "rs-1", "ck-1", "/r", {"env-a": [ref(1), ref(2)]}, {}, soon()
        )
    assert not result.ok and "run-2_g0-a1" in result.errors["env-a"]
    assert a.bodies("resume")


# -- EnvFleet: open (renewals, resume on exit) ----------------------------------------------------


async def test_open_renews_in_the_background_and_resumes_on_exit() -> None:
    a, b = FakeInstance("env-a"), FakeInstance("env-b")
    deadline = soon(0.5)
    async with fleet_of(a, b) as fleet:
        async with fleet.open("ck-1", deadline, renew_every_s=0.02) as prepared:
            assert prepared.checkpoint_id == "ck-1"
            await eventually_async(
                lambda: len(a.bodies("renew")) >= 3 and len(b.bodies("renew")) >= 3,
                what="three renewals on each instance while the block runs",
            )
            assert not a.bodies("resume")
        renewed = len(a.bodies("renew"))
        await asyncio.sleep(0.1)  # not a wait for something: a window in which none may come
    assert renewed >= 3 and len(b.bodies("renew")) >= 3
    assert len(a.bodies("renew")) == renewed  # the renewals stopped with the block
    assert all(body["deadline_ts"] > deadline - 0.5 for body in a.bodies("renew"))
    assert a.bodies("resume") == b.bodies("resume") == [{"checkpoint_id": "ck-1"}]


async def test_open_resumes_all_when_the_body_raises_and_keeps_its_error() -> None:
    a, b = FakeInstance("env-a"), FakeInstance("env-b")
    a.faults["resume"] = refuse(503, "EnvUnavailable", "down")
    b.faults["renew"] = refuse(409, "wrong_phase", "lease ran out")
    boom = RuntimeError("capture failed")

    async def capture_fails(fleet: EnvFleet) -> None:
        async with fleet.open("ck-1", soon(), renew_every_s=0.02):
            # A second renewal on env-a means the first round ended, env-b's refusal noted.
            await eventually_async(
                lambda: len(a.bodies("renew")) >= 2, what="a second round of renewals"
            )
            raise boom

    async with fleet_of(a, b) as fleet:
        with pytest.raises(RuntimeError) as info:
            await capture_fails(fleet)
        renewed = len(a.bodies("renew"))
        await asyncio.sleep(0.1)  # not a wait for something: a window in which none may come
    assert info.value is boom
    assert any("resume on env-a failed" in note for note in boom.__notes__)
    assert any("renewal on env-b failed" in note for note in boom.__notes__)
    assert a.bodies("resume") and b.bodies("resume")
    assert renewed >= 1 and len(a.bodies("renew")) == renewed  # renewals stopped too


# -- EnvFleet: episodes ---------------------------------------------------------------------------


async def test_run_episode_resends_the_identical_run_once_idle() -> None:
    a = FakeInstance("env-a")
    a.phase, a.idle_after_polls = "prepared", 2
    run = RunEpisode(episode=ref(1, attempt=2), task={"prompt": "p"})
    async with fleet_of(a) as fleet:
        result = await fleet.run_episode("env-a", run, parked_retry_s=0.01)
    assert result.episode == ref(1, attempt=2)
    sent = a.bodies("run")
    assert len(sent) == 2 and sent[0] == sent[1] == json.loads(run.model_dump_json())
    assert len(a.bodies("status")) == 2


async def test_run_episode_gives_up_after_max_wait() -> None:
    a = FakeInstance("env-a")
    a.phase = "prepared"
    async with fleet_of(a) as fleet:
        with pytest.raises(EpisodeParked) as info:
            await fleet.run_episode(
                "env-a", RunEpisode(episode=ref(1)), parked_retry_s=0.01, max_wait_s=0.1
            )
    assert any("still parked" in note for note in info.value.__notes__)


async def test_an_instance_that_does_not_answer_never_holds_back_another_instances_run_lease() -> (
    None
):
    """Each instance's run lease is renewed on its own schedule: while b sits on its first
    renewal, a's lease goes on being renewed (in one round for all, a would wait for b, and
    a loaded instance could let the others' leases run out)."""
    a, b = FakeInstance("env-a"), FakeInstance("env-b")
    answer_b = asyncio.Event()

    async def stuck(request: httpx.Request) -> httpx.Response | None:
        await answer_b.wait()
        return None  # then the protocol's reply

    b.faults["lease"] = stuck
    async with fleet_of(a, b) as fleet:
        keeper = asyncio.create_task(fleet.keep_run_lease(RunLease(holder="d-1", ttl_s=5.0), 0.01))
        try:
            await eventually_async(lambda: len(a.bodies("lease")) >= 3, what="a renewed again")
            assert len(b.bodies("lease")) == 1  # still on its first
            answer_b.set()
            await eventually_async(lambda: len(b.bodies("lease")) >= 2, what="b renewed again")
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)


async def test_a_failed_renewal_is_logged_once_per_outage_with_what_raised_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An instance that is down (EnvUnavailable) is one WARNING line; anything else that makes
    a renewal fail (a 422, a bug) is one WARNING with its traceback, not swallowed."""
    a, b = FakeInstance("env-a"), FakeInstance("env-b")
    a.faults["lease"] = refuse(503, "EnvUnavailable", "injected fault: down")
    b.faults["lease"] = refuse(422, "InvalidInput", "RunLease: holder: bad")
    async with fleet_of(a, b) as fleet:
        keeper = asyncio.create_task(fleet.keep_run_lease(RunLease(holder="d-1", ttl_s=5.0), 0.01))
        try:
            await eventually_async(
                lambda: len(a.bodies("lease")) >= 3 and len(b.bodies("lease")) >= 3,
                what="each renewed three times",
            )
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
    warned = {r.getMessage().split(" not renewed")[0][-5:]: r for r in caplog.records}
    assert sorted(warned) == ["env-a", "env-b"]  # once each, however many rounds failed
    assert not warned["env-a"].exc_info  # an outage: its line says enough
    traced = warned["env-b"].exc_info
    assert isinstance(traced, tuple) and traced[0] is InvalidInput  # with its traceback
    assert "InvalidInput" in warned["env-b"].getMessage()


# -- EnvFleet: input checks -----------------------------------------------------------------------


async def test_fleet_refuses_unknown_instances_and_unsafe_names() -> None:
    with pytest.raises(InvalidInput):
        EnvFleet({"../x": client_for(FakeInstance("env-a"))})
    a = FakeInstance("env-a")
    async with fleet_of(a) as fleet:
        with pytest.raises(InvalidInput, match="env-q"):
            await fleet.retire_all({"env-q": [ref(1)]})
        with pytest.raises(InvalidInput, match="env-q"):
            await fleet.run_episode("env-q", RunEpisode(episode=ref(1)))
    assert a.calls == []


async def test_run_episode_waits_through_a_parked_instance_that_cannot_answer_for_now() -> None:
    a = FakeInstance("env-a")
    a.phase, a.idle_after_polls = "prepared", 1
    down = [refuse(503, "EnvUnavailable", "injected fault: unavailable")]

    async def once(request: httpx.Request) -> httpx.Response | None:
        return await down.pop()(request) if down else None

    a.faults["status"] = once
    run = RunEpisode(episode=ref(1), task={"prompt": "p"})
    async with fleet_of(a) as fleet:
        result = await fleet.run_episode("env-a", run, parked_retry_s=0.01)
    assert result.episode == ref(1)
    assert len(a.bodies("status")) == 2 and len(a.bodies("run")) == 2


async def test_restore_all_sends_a_lost_instances_episodes_to_their_adopter() -> None:
    a, b = FakeInstance("env-a"), FakeInstance("env-b")
    adopted = {"env-b": {"env-z": [ref(3), ref(4)]}}
    async with fleet_of(a, b) as fleet:
        result = await fleet.restore_all(
            "rs-1", "ck-1", "/snap/env", {"env-a": [ref(1)]}, {}, soon(), adopted=adopted
        )
    assert result.ok
    assert result.restored["env-b"] == (ref(3, attempt=1), ref(4, attempt=1))
    (body,) = b.bodies("restore")
    assert body["scope"] == [] and body["root"] == "/snap/env/env-b"
    scope = [r.model_dump() for r in (ref(3), ref(4))]
    assert body["adopted"] == [{"instance": "env-z", "root": "/snap/env/env-z", "scope": scope}]


async def test_restore_all_refuses_an_adopter_outside_the_fleet() -> None:
    async with fleet_of(FakeInstance("env-a")) as fleet:
        with pytest.raises(TopologyMismatch, match="adopting instances names unknown"):
            await fleet.restore_all(
                "rs-1", "ck-1", "/r", {}, {}, soon(), adopted={"env-q": {"env-z": [ref(1)]}}
            )


# -- place: a restore onto a fleet that lost (or gained) instances -------------------------------


def test_place_keeps_each_instances_own_and_spreads_a_lost_ones_over_the_fewest_loaded() -> None:
    scope = {"a": [ref(1)], "b": [ref(2), ref(3)], "z": [ref(4), ref(5), ref(6)]}
    placement = place(scope, {"z": True}, ["a", "b", "c"])
    assert placement.own == {"a": (ref(1),), "b": (ref(2), ref(3))}
    # c (new, 0) takes the first, then a and c (1 each, a first by name), ...
    assert placement.adopted == {"c": {"z": (ref(4), ref(6))}, "a": {"z": (ref(5),)}}
    assert placement.moved == {ref(4): "c", ref(5): "a", ref(6): "c"}
    assert placement.stranded == ()
    assert placement.lost == {"z": "not in the fleet: 3 episode(s) restored on a (1), c (2)"}


def test_place_restarts_a_lost_instances_episodes_when_its_records_are_not_portable() -> None:
    placement = place({"a": [ref(1)], "z": [ref(2)]}, {"z": False}, ["a"])
    assert placement.adopted == {} and placement.stranded == (ref(2),)
    assert "not portable" in placement.lost["z"] and "restart from scratch" in placement.lost["z"]


def test_place_on_the_same_fleet_moves_nothing() -> None:
    scope = {"a": [ref(1)], "b": []}
    placement = place(scope, {}, ["a", "b"])
    assert placement.own == {"a": (ref(1),)}
    assert (placement.adopted, placement.stranded, placement.lost) == ({}, (), {})


async def test_an_instance_the_run_names_otherwise_is_refused_at_first_contact_naming_both() -> (
    None
):
    a = FakeInstance("env-a")
    run = RunEpisode(episode=ref(1), task={"prompt": "p"})
    async with EnvFleet({"w0": client_for(a)}) as fleet:
        with pytest.raises(InvalidInput) as info:
            await fleet.run_episode("w0", run)
        message = str(info.value)
        assert "participants.envs names the instance at http://env-a.test:8000 'w0'" in message
        assert "it calls itself 'env-a'" in message and "`--instance w0`" in message
        with pytest.raises(InvalidInput, match="calls itself 'env-a'"):
            await fleet.prepare_all("ck-1", soon())
    assert a.bodies("run") == [] and a.bodies("prepare") == []  # nothing reached it
    asked = len(a.bodies("status"))
    async with fleet_of(a) as fleet:  # named as it names itself: one status, then calls
        await fleet.run_episode("env-a", run)
        await fleet.run_episode("env-a", run.model_copy(update={"episode": ref(2)}))
    assert len(a.bodies("status")) == asked + 1 and len(a.bodies("run")) == 2


async def test_an_instance_that_predates_run_leases_runs_the_episode_without_one() -> None:
    a = FakeInstance("env-a")
    old = refuse(422, "InvalidInput", "RunEpisode: lease: Extra inputs are not permitted")

    async def predates_leases(request: httpx.Request) -> httpx.Response | None:
        return await old(request) if "lease" in json.loads(request.content) else None

    a.faults["run"] = predates_leases
    lease = RunLease(holder="dispatcher-1", ttl_s=5.0)
    run = RunEpisode(episode=ref(1), task={"prompt": "p"}, lease=lease)
    async with fleet_of(a) as fleet:
        assert (await fleet.run_episode("env-a", run)).episode == ref(1)
        await fleet.run_episode("env-a", run.model_copy(update={"episode": ref(2)}))
    sent = a.bodies("run")
    assert ["lease" in body for body in sent] == [True, False, False]  # asked once, then known
