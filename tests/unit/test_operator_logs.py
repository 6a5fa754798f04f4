"""The log lines operators read, with the fields the JSON format carries: the controller's phase
and restore outcomes (failures with the error's class), the snapshot store's publishes,
retention deletions and passed-over candidates, the participants' stragglers, lost cuts,
unexported episodes and failing instances, and each phase activity's outcome on Temporal's
activity logger. No line holds a bearer token."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from rollsafe.activities.snapshot import SnapshotActivities
from rollsafe.checkpoint.controller import Controller
from rollsafe.checkpoint.participants import ParticipantOptions, Participants
from rollsafe.checkpoint.phases import commit_envs, cut_generation, prepare_envs
from rollsafe.checkpoint.phases.drain import wait_for_replies
from rollsafe.core.config import RunConfig
from rollsafe.core.phases import (
    PHASES,
    Phase,
    PhaseRequest,
    PhaseResult,
    RestoreRequest,
    SnapshotSpec,
)
from rollsafe.engine.protocol import CutRefusal
from rollsafe.engine.staging import StagedCut
from rollsafe.env.client import EnvClient
from rollsafe.env.fleet_instances import Instances
from rollsafe.env.fleet_rules import (
    FleetCommitted,
    FleetPrepared,
    InstanceCommit,
    InstanceInventory,
)
from rollsafe.env.protocol import EpisodeRef
from rollsafe.errors import (
    EnvNotReady,
    EnvUnavailable,
    InjectedFault,
    RollsafeError,
    SnapshotCorrupt,
    SnapshotLost,
)
from rollsafe.evidence.scenario import row_content
from rollsafe.faults import ENV_VAR, arm, disarm_all
from rollsafe.loop_thread import LoopThread

TOKEN = "secret-bearer-token"

if TYPE_CHECKING:

    class Line(logging.LogRecord):
        """A record whose ``extra`` fields (set at runtime) are read as attributes."""

        def __getattr__(self, name: str) -> Any: ...


@pytest.fixture(autouse=True)
def _no_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(ENV_VAR, raising=False)
    disarm_all()
    yield
    disarm_all()


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="rollsafe")
    return caplog


def records(caplog: pytest.LogCaptureFixture, logger: str) -> list[Line]:
    return cast("list[Line]", [r for r in caplog.records if r.name == logger])


def controller(tmp_path: Path, keep_latest_k: int = 3) -> Controller:
    config = RunConfig(run_id=f"l-{uuid.uuid4().hex[:8]}", group_size=2, groups_per_step=1)
    ops = Controller(config, tmp_path, keep_latest_k=keep_latest_k)
    ops.handout([0, 1])
    for i in range(2):
        episode = ops.dispatch(0, i)
        assert episode is not None
        ops.seal(0, i, episode.attempt, row_content(0, i, episode.attempt))
    return ops


def snapshot(ops: Controller, seq: int) -> SnapshotSpec:
    spec = SnapshotSpec(run_id=ops.store.run_id, seq=seq)
    for phase in PHASES:
        ops.run_phase(PhaseRequest(spec=spec, phase=phase))
    return spec


def test_each_phase_outcome_is_one_line_with_its_fields(
    tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    ops = controller(tmp_path)
    spec = snapshot(ops, 1)
    snapshot(ops, 1)  # a replayed workflow: every phase answers from its stored result
    lines = [r for r in records(logs, "rollsafe.checkpoint.controller") if hasattr(r, "phase")]
    assert [r.phase for r in lines] == [p.value for p in PHASES] * 2
    assert [r.replayed for r in lines] == [False] * len(PHASES) + [True] * len(PHASES)
    for line in lines:
        assert line.levelno == logging.DEBUG  # the activity's INFO line says it where it runs
        assert (line.run_id, line.checkpoint_id) == (spec.run_id, spec.checkpoint_id)
        assert line.seconds >= 0
        assert spec.checkpoint_id in line.getMessage()
    capture = lines[PHASES.index(Phase.CAPTURE)].getMessage()
    assert "captured 2 groups, 2 sealed rollouts" in capture


def test_a_failed_phase_names_the_error_class_and_its_transience(
    tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    ops = controller(tmp_path)
    spec = SnapshotSpec(run_id=ops.store.run_id, seq=1)
    for phase in PHASES[:-1]:
        ops.run_phase(PhaseRequest(spec=spec, phase=phase))
    arm("store.before_latest", "raise")  # inside publish
    with pytest.raises(InjectedFault):
        ops.run_phase(PhaseRequest(spec=spec, phase=Phase.PUBLISH))
    [failed] = [
        r
        for r in records(logs, "rollsafe.checkpoint.controller")
        if getattr(r, "error_type", None) is not None
    ]
    assert failed.levelno == logging.WARNING  # transient: the next attempt may succeed
    assert (failed.phase, failed.error_type, failed.transient) == ("publish", "InjectedFault", True)
    assert "phase publish failed" in failed.getMessage() and "InjectedFault" in failed.getMessage()


def test_a_restore_is_one_line_with_the_plans_counts(
    tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    ops = controller(tmp_path)
    snapshot(ops, 1)
    plan = ops.restore(RestoreRequest(run_id=ops.store.run_id, restore_id="r1"))
    ops.restore(RestoreRequest(run_id=ops.store.run_id, restore_id="r1"))
    lines = [r for r in records(logs, "rollsafe.checkpoint.controller") if hasattr(r, "restore_id")]
    first, again = lines
    assert first.levelno == logging.INFO
    assert (first.snapshot, first.ready_groups, first.partial_groups) == (plan.snapshot, 1, 1)
    assert "1 ready groups, 1 partial groups" in first.getMessage()
    assert "replayed" in again.getMessage()


def test_the_store_logs_publishes_and_retention(
    tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    ops = controller(tmp_path, keep_latest_k=1)
    snapshot(ops, 1)
    snapshot(ops, 2)
    lines = records(logs, "rollsafe.snapshot.store")
    published = [r.snapshot for r in lines if hasattr(r, "reused")]
    deleted = [r.snapshot for r in lines if "retention deleted" in r.getMessage()]
    assert published == ["00000001-rollout", "00000002-rollout"]
    assert deleted == ["00000001-rollout"]
    assert all(r.levelno == logging.INFO for r in lines if r.snapshot in published)


def test_a_restore_names_each_candidate_it_passed_over(
    tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    ops = controller(tmp_path)
    snapshot(ops, 1)
    spec = snapshot(ops, 2)
    newest = ops.store.snapshots_dir / "00000002-rollout"
    damaged = next(p for p in sorted(newest.iterdir()) if p.name != "manifest.json" and p.is_file())
    damaged.write_bytes(damaged.read_bytes() + b"!")
    plan = ops.restore(RestoreRequest(run_id=spec.run_id, restore_id="r1"))
    assert plan.snapshot == "00000001-rollout"
    [passed] = [
        r for r in records(logs, "rollsafe.snapshot.store") if "passed over" in r.getMessage()
    ]
    assert passed.levelno == logging.WARNING and passed.snapshot == "00000002-rollout"


def parked(checkpoint_id: str, restarts: tuple[EpisodeRef, ...]) -> FleetPrepared:
    return FleetPrepared(
        checkpoint_id=checkpoint_id,
        deadline_ts=time.time() + 30,
        instances={
            "w0": InstanceInventory(parked=(), restarts=restarts, lease_expires_ts=time.time())
        },
    )


def test_participants_log_stragglers_lost_cuts_unexported_and_restarts(
    logs: pytest.LogCaptureFixture,
) -> None:
    ref = EpisodeRef(rollout_id="run-3_g0", attempt=1)
    loop = LoopThread("test-logs")
    try:
        options = ParticipantOptions(drain_timeout_s=0)
        participants = Participants(None, {}, loop=loop, options=options)  # type: ignore[arg-type]
        participants.pending.add(ref, "w0")  # a reply still on the wire: not in the scope
        assert wait_for_replies(participants, parked("c1", ())) == [ref]
    finally:
        loop.close()
    prepare_envs._log_prepared(parked("c1", (ref,)))
    cut_generation._log_cut(
        "c1",
        StagedCut(
            staged={"a": 3},
            refused=(
                CutRefusal(call_id="b", reason="unknown_call"),
                CutRefusal(call_id="c", reason="constrained_decoding", detail="grammar"),
            ),
            handoffs=0,
        ),
    )
    commit_envs._log_committed(
        FleetCommitted(
            checkpoint_id="c1",
            instances={
                "w0": InstanceCommit(dest="/d/w0", committed=(), missing=(ref,), participants=())
            },
        )
    )
    lines = {r.getMessage(): r.levelno for r in records(logs, "rollsafe.checkpoint.participants")}
    expected = {
        "1 replies still out after the 0 s drain": logging.WARNING,
        "instance w0 could not park 1 episodes (they restart): run-3_g0#1": logging.INFO,
        "1 generation calls could not be cut and restart from their turn: "
        "c (constrained_decoding: grammar)": logging.WARNING,
        "instance w0 did not export 1 episodes of its scope": logging.WARNING,
        "1 calls cut, 0 skipped (coarser level), 1 not started or done": logging.DEBUG,
    }
    for text, level in expected.items():
        assert [lv for message, lv in lines.items() if text in message] == [level], text


def test_each_failing_instance_is_one_line_without_its_token(
    logs: pytest.LogCaptureFixture,
) -> None:
    instances = Instances({name: EnvClient(f"http://{name}", TOKEN) for name in ("w0", "w1")})
    error = instances.summary(
        "prepare", {"w0": EnvNotReady("not ready: tool running"), "w1": EnvUnavailable("refused")}
    )
    assert isinstance(error, EnvUnavailable)
    lines = records(logs, "rollsafe.env.fleet_instances")
    assert [(r.instance, r.error_type, r.levelno) for r in lines] == [
        ("w0", "EnvNotReady", logging.WARNING),
        ("w1", "EnvUnavailable", logging.WARNING),
    ]
    assert "prepare failed on environment instance w0: EnvNotReady" in lines[0].getMessage()


def test_no_line_holds_a_token(tmp_path: Path, logs: pytest.LogCaptureFixture) -> None:
    """Every line the other tests here produce, once more, searched for the token."""
    test_each_failing_instance_is_one_line_without_its_token(logs)
    test_each_phase_outcome_is_one_line_with_its_fields(tmp_path, logs)
    assert logs.records and all(TOKEN not in _everything(r) for r in logs.records)


def _everything(record: logging.LogRecord) -> str:
    fields: dict[str, Any] = dict(record.__dict__)
    return f"{record.getMessage()} {fields}"


# ---- the phase activities: temporalio.activity.logger, in an ActivityEnvironment ---------------


class PhaseClient:
    """A controller client whose run_phase answers ``result`` or raises ``error``."""

    def __init__(self, error: Exception | None = None, replayed: bool = False) -> None:
        self.error = error
        self.replayed = replayed

    async def run_phase(self, request: PhaseRequest) -> PhaseResult:
        if self.error is not None:
            raise self.error
        return PhaseResult(
            phase=request.phase,
            checkpoint_id=request.spec.checkpoint_id,
            summary="did it",
            replayed=self.replayed,
        )

    async def renew_admission(self, spec: SnapshotSpec) -> bool:
        return True


async def run_activity(client: PhaseClient, phase: Phase) -> PhaseResult:
    activities = SnapshotActivities(lambda run_id: client)  # type: ignore[arg-type, return-value]
    request = PhaseRequest(spec=SnapshotSpec(run_id="act", seq=4), phase=phase)
    result: PhaseResult = await ActivityEnvironment().run(
        activities._phase_activity(phase), request
    )
    return result


@pytest.mark.parametrize("replayed", [False, True])
async def test_a_phase_activity_logs_its_outcome_at_info(
    caplog: pytest.LogCaptureFixture, replayed: bool
) -> None:
    caplog.set_level(logging.INFO, logger="temporalio.activity")
    await run_activity(PhaseClient(replayed=replayed), Phase.DRAIN)
    [line] = records(caplog, "temporalio.activity")
    assert line.levelno == logging.INFO
    assert (line.phase, line.checkpoint_id, line.replayed) == (
        "drain",
        "act.rollout.00000004",
        replayed,
    )
    assert line.seconds >= 0 and "did it" in line.getMessage()
    assert "temporal_activity" in line.__dict__  # Temporal's own details ride along


@pytest.mark.parametrize(
    ("error", "transient"),
    [(SnapshotLost("draft gone"), True), (SnapshotCorrupt("bad digest"), False)],
)
async def test_a_failed_phase_activity_warns_with_type_and_transience(
    caplog: pytest.LogCaptureFixture, error: RollsafeError, transient: bool
) -> None:
    caplog.set_level(logging.INFO, logger="temporalio.activity")
    with pytest.raises(ApplicationError):
        await run_activity(PhaseClient(error=error), Phase.CAPTURE)
    [line] = records(caplog, "temporalio.activity")
    assert line.levelno == logging.WARNING
    assert (line.phase, line.error_type, line.transient) == (
        "capture",
        type(error).__name__,
        transient,
    )
