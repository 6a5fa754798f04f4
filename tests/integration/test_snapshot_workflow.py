"""The snapshot workflows on a real Temporal dev server with a real worker, the controller in
this process (the Ray actor and killed-worker tests live in test_checkpoint_crash.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import pytest
from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import ActivityError, ApplicationError

from rollsafe.core.ids import restore_workflow_id, supervisor_id
from rollsafe.core.phases import PARK_WINDOW, PHASES, Phase, RestoreRequest
from rollsafe.dataplane import make_dataplane
from rollsafe.evidence.scenario import row_content
from rollsafe.faults import arm
from rollsafe.snapshot import state_files
from rollsafe.temporal.devserver import DevServer
from rollsafe.temporal.history import completed_activities
from rollsafe.testing.waiting import eventually_async, holding
from rollsafe.workflows.models import PhaseOptions, SupervisorStatus
from rollsafe.workflows.restore import RestoreRun
from rollsafe.workflows.snapshot import RolloutSnapshot
from rollsafe.workflows.supervisor import SnapshotSupervisor

if TYPE_CHECKING:
    from tests.integration.conftest import WorkflowHarness


async def test_a_snapshot_runs_the_ten_phases_once_and_publishes(harness: WorkflowHarness) -> None:
    async with harness.worker():
        outcome = await harness.snapshot()
    assert outcome.status == "published", outcome.reason
    assert [r.phase for r in outcome.phases] == list(PHASES)
    assert outcome.published is not None and outcome.published.counts["sealed_rollouts"] == 3
    status = harness.controller.status()
    assert status.gate_open and status.open_checkpoint is None
    assert all(status.effects[p.value] == 1 for p in (Phase.OPEN, Phase.CAPTURE, Phase.PUBLISH))
    _, plan = state_files.restore(
        harness.controller.state.config, harness.store, make_dataplane("memory")
    )
    assert plan.checkpoint_id == outcome.checkpoint_id and plan.ready == [0]


async def test_a_transient_phase_failure_is_retried(harness: WorkflowHarness) -> None:
    arm("phase.capture.before", "raise", times=2)
    async with harness.worker():
        outcome = await harness.snapshot()
    assert outcome.status == "published"
    assert harness.controller.status().effects["capture"] == 1


async def test_a_persistent_failure_fails_the_snapshot_and_reopens_admission(
    harness: WorkflowHarness,
) -> None:
    arm("phase.capture.before", "raise")
    async with harness.worker():
        outcome = await harness.snapshot()
    assert outcome.status == "failed" and outcome.transient
    assert outcome.error_type == "InjectedFault"
    status = harness.controller.status()
    assert status.gate_open and status.open_checkpoint is None
    assert harness.store.list() == []


async def test_abort_before_capture_skips_and_after_is_too_late(harness: WorkflowHarness) -> None:
    async with harness.worker():
        with holding("phase.drain.before") as drain:
            handle = await harness.start_snapshot(1)
            await drain.reached_async()  # the snapshot stands in drain until released
            assert (await handle.query(RolloutSnapshot.status)).phase == Phase.DRAIN
            answer = await handle.execute_update(RolloutSnapshot.abort, "trainer step 7")
            assert "drain" in answer
        outcome = await handle.result()
        assert outcome.status == "skipped" and "trainer step 7" in outcome.reason
        assert harness.store.list() == [] and harness.controller.status().gate_open

        with holding("phase.publish.before") as publish:
            handle = await harness.start_snapshot(2)
            await publish.reached_async()
            assert (await handle.query(RolloutSnapshot.status)).phase == Phase.PUBLISH
            with pytest.raises(WorkflowUpdateFailedError) as late:
                await handle.execute_update(RolloutSnapshot.abort, "trainer step 8")
            assert "too late" in str(late.value.cause)
        assert (await handle.result()).status == "published"


async def test_supervisor_counts_consecutive_failures_then_fails(harness: WorkflowHarness) -> None:
    arm("phase.capture.before", "raise")
    async with harness.worker():
        handle = await harness.start_supervisor(max_consecutive_failures=2)
        first = await handle.execute_update(SnapshotSupervisor.snapshot_now)
        assert first.status == "failed" and first.seq == 1
        status = await handle.query(SnapshotSupervisor.status)
        assert status.state.consecutive_failures == 1
        second = await handle.execute_update(SnapshotSupervisor.snapshot_now)
        assert second.status == "failed" and second.seq == 2
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        cause = failed.value.cause
        assert isinstance(cause, ApplicationError)
        assert cause.type == "TooManyConsecutiveSnapshotFailures" and cause.non_retryable
    assert harness.controller.status().gate_open


async def test_supervisor_snapshot_now_publishes_and_resets_the_count(
    harness: WorkflowHarness,
) -> None:
    arm("phase.capture.before", "raise", times=3)  # the first snapshot's 3 attempts
    async with harness.worker():
        handle = await harness.start_supervisor()
        assert (await handle.execute_update(SnapshotSupervisor.snapshot_now)).status == "failed"
        second = await handle.execute_update(SnapshotSupervisor.snapshot_now)
        assert second.status == "published" and second.seq == 2
        status = await handle.query(SnapshotSupervisor.status)
        assert status.state.consecutive_failures == 0 and status.state.published == 1
        await handle.signal(SnapshotSupervisor.stop)
        await handle.result()


async def test_snapshots_unpublished_in_a_row_warn_and_set_a_gauge(
    harness: WorkflowHarness, server: DevServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Two failed snapshots (of ten allowed) with warn_unpublished_after=2: the second is a
    WARNING naming the count, the status says so, the gauge reads 2; a published one clears
    all three. The gauge is read from a metric buffer on the worker's own Temporal runtime."""
    from temporalio.client import Client
    from temporalio.runtime import MetricBuffer, Runtime, TelemetryConfig

    from rollsafe.temporal.converter import data_converter
    from rollsafe.workers.checkpoint import build_worker
    from rollsafe.workflows.supervisor import UNPUBLISHED_GAUGE

    caplog.set_level(logging.WARNING, logger="temporalio.workflow")
    buffer = MetricBuffer(10_000)
    gauge = GaugeReader(buffer)
    client = await Client.connect(
        server.address,
        namespace=server.namespace,
        data_converter=data_converter,
        runtime=Runtime(telemetry=TelemetryConfig(metrics=buffer)),
    )
    arm("phase.capture.before", "raise", times=6)  # two snapshots' 3 attempts each
    async with build_worker(client, harness.task_queue, lambda run_id: harness.local):
        handle = await harness.start_supervisor(
            max_consecutive_failures=10, warn_unpublished_after=2
        )
        for _ in range(2):
            assert (await handle.execute_update(SnapshotSupervisor.snapshot_now)).status == "failed"
        status = await handle.query(SnapshotSupervisor.status)
        assert status.state.unpublished_in_a_row == 2 and status.state.published == 0
        assert status.warning is not None and status.warning.startswith(
            "2 snapshots in a row ended unpublished (no snapshot published yet"
        )
        warned: list[Any] = [
            r for r in caplog.records if "in a row ended unpublished" in r.getMessage()
        ]
        assert [r.unpublished_in_a_row for r in warned] == [2]  # not at 1: below the threshold
        assert gauge(UNPUBLISHED_GAUGE) == 2
        assert (await handle.execute_update(SnapshotSupervisor.snapshot_now)).status == "published"
        status = await handle.query(SnapshotSupervisor.status)
        assert status.warning is None and status.state.unpublished_in_a_row == 0
        assert gauge(UNPUBLISHED_GAUGE) == 0
        await handle.signal(SnapshotSupervisor.stop)
        await handle.result()


class GaugeReader:
    """The newest value of each gauge among a metric buffer's updates so far (retrieving
    empties the buffer, so the values seen are kept)."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.values: dict[str, list[int]] = {}

    def __call__(self, name: str) -> int | None:
        for update in self.buffer.retrieve_updates():
            self.values.setdefault(update.metric.name, []).append(update.value)
        seen = self.values.get(name, [])
        return seen[-1] if seen else None


async def test_restore_workflow_brings_the_run_back_from_its_newest_snapshot(
    harness: WorkflowHarness,
) -> None:
    async with harness.worker():
        assert (await harness.snapshot()).status == "published"
        # The run moves on after the snapshot: one more seal that the restore must undo.
        live = harness.controller.state
        live.dispatch(2, 0)
        live.seal(2, 0, 0, row_content(2, 0, 0))
        request = RestoreRequest(run_id=harness.run_id, restore_id="r1")
        plan = await harness.client.execute_workflow(
            RestoreRun.run,
            request,
            id=restore_workflow_id(harness.run_id, "r1"),
            task_queue=harness.task_queue,
        )
        again = await harness.client.execute_workflow(
            RestoreRun.run,
            request,
            id=restore_workflow_id(harness.run_id, "r1-retry"),
            task_queue=harness.task_queue,
        )
    assert plan.ready == [0] and sorted(plan.partial) == [1, 2]
    assert plan.partial[1].restored == [0] and plan.partial[2].restored == []
    assert again == plan  # idempotent per restore id: the run was not restored twice
    assert harness.controller.state is not live
    assert harness.controller.state.ledger.sealed(2) == []


async def test_restore_without_a_snapshot_fails_naming_it(harness: WorkflowHarness) -> None:
    async with harness.worker():
        with pytest.raises(WorkflowFailureError) as failed:
            await harness.client.execute_workflow(
                RestoreRun.run,
                RestoreRequest(run_id=harness.run_id, restore_id="r0"),
                id=restore_workflow_id(harness.run_id, "r0"),
                task_queue=harness.task_queue,
            )
    assert isinstance(failed.value.cause, ActivityError)
    cause = failed.value.cause.cause  # WorkflowFailure -> ActivityError -> ApplicationError
    assert isinstance(cause, ApplicationError) and cause.type == "NoValidSnapshot"
    assert cause.non_retryable and "no snapshot" in str(cause)


async def test_periodic_snapshots_continue_as_new_carrying_their_state(
    harness: WorkflowHarness,
) -> None:
    async with harness.worker():
        handle = await harness.start_supervisor(interval_s=0.2, snapshots_per_run=2)
        first_run = handle.first_execution_run_id or handle.result_run_id

        async def three_published() -> SupervisorStatus | None:  # periodic, no requests
            status = await handle.query(SnapshotSupervisor.status)
            return status if status.state.published >= 3 else None

        status: SupervisorStatus | None = await eventually_async(
            three_published, what="three periodic snapshots"
        )
        assert status is not None
        latest = await harness.client.get_workflow_handle(supervisor_id(harness.run_id)).describe()
        await handle.signal(SnapshotSupervisor.stop)
    assert latest.run_id != first_run  # continued as new after 2 snapshots
    assert status.state.next_seq == status.state.published + 1  # seqs carried on, none reused
    # Snapshots kept by retention: the newest two, seq 3 or later (more may have been taken
    # between the status query and the stop).
    kept = [e.seq for e in harness.store.list() if e.state.value == "valid"]
    assert len(kept) == 2 and kept[0] is not None and kept[0] >= 3


async def test_an_invariant_failure_fails_the_supervisor_at_once(harness: WorkflowHarness) -> None:
    arm("phase.capture.before", "invariant")
    async with harness.worker():
        handle = await harness.start_supervisor(max_consecutive_failures=3)
        outcome = await handle.execute_update(SnapshotSupervisor.snapshot_now)
        assert outcome.status == "failed" and not outcome.transient
        assert [r.phase for r in outcome.phases].count(Phase.CAPTURE) == 0  # never retried
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.non_retryable
    assert cause.type == "InjectedInvariantFault"
    assert harness.controller.status().gate_open and harness.store.list() == []


async def test_the_park_windows_phases_run_as_local_activities(harness: WorkflowHarness) -> None:
    async with harness.worker():
        handle = await harness.start_snapshot(1)
        outcome = await handle.result()
    assert outcome.status == "published"
    assert [r.phase for r in outcome.phases] == list(PHASES)
    events = [event async for event in handle.fetch_history_events()]
    done = completed_activities(events)
    assert [a.name for a in done] == [p.value for p in PHASES]
    # Only open and publish (disk work, outside the window) go through the task queue.
    assert [a.name for a in done if not a.local] == ["open", "publish"]
    assert {a.name for a in done if a.local} == {p.value for p in PARK_WINDOW}


async def test_with_the_option_off_every_phase_is_a_regular_activity(
    harness: WorkflowHarness,
) -> None:
    options = PhaseOptions(retry_initial_s=0.05, retry_maximum_s=0.2, local_park_window=False)
    async with harness.worker():
        handle = await harness.start_snapshot(1, options=options)
        assert (await handle.result()).status == "published"
    done = completed_activities([event async for event in handle.fetch_history_events()])
    assert [a.name for a in done if not a.local] == [p.value for p in PHASES]


async def test_a_cancelled_snapshot_still_resumes_and_discards_its_draft(
    harness: WorkflowHarness,
) -> None:
    async with harness.worker():
        with holding("phase.drain.before") as drain:
            handle = await harness.start_snapshot(1)
            await drain.reached_async()
            assert await harness.snapshot_phase(1) == Phase.DRAIN
            assert not harness.controller.status().gate_open  # parked: admission closed
            await handle.cancel()
            # The cancel reaches drain, a local activity, at its workflow task's heartbeat;
            # the workflow then resumes while drain is still held.
            await eventually_async(
                lambda: harness.controller.status().effects["resume"] == 1,
                what="resume run by the cancelled snapshot",
            )
        with pytest.raises(WorkflowFailureError) as cancelled:
            await handle.result()
    assert "cancel" in repr(cancelled.value.cause).lower()
    status = harness.controller.status()
    assert status.gate_open and status.open_checkpoint is None
    assert status.effects["resume"] == 1 and status.effects["abort"] == 1
    assert harness.store.list() == []


def _lines(caplog: pytest.LogCaptureFixture, logger: str, **fields: object) -> list[Any]:
    """Records of ``logger`` carrying every one of ``fields`` with that value."""
    return [
        r
        for r in caplog.records
        if r.name == logger and all(getattr(r, k, _MISSING) == v for k, v in fields.items())
    ]


_MISSING = object()


async def test_each_phase_and_the_outcome_are_logged_once(
    harness: WorkflowHarness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="temporalio")
    async with harness.worker():
        outcome = await harness.snapshot()
    assert outcome.status == "published"
    phases = [r for r in _lines(caplog, "temporalio.activity") if hasattr(r, "phase")]
    assert [r.phase for r in phases] == [p.value for p in PHASES]  # one INFO line each
    for line in phases:
        assert line.levelno == logging.INFO and line.replayed is False and line.seconds >= 0
        assert line.checkpoint_id == outcome.checkpoint_id
        assert line.temporal_activity["activity_type"] == line.phase
    [done] = _lines(caplog, "temporalio.workflow", status="published")
    assert outcome.published is not None and outcome.published.name in done.getMessage()
    assert done.temporal_workflow["workflow_type"] == "RolloutSnapshot"


async def test_failures_are_logged_with_their_type_and_transience(
    harness: WorkflowHarness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="temporalio")
    arm("phase.capture.before", "raise")
    async with harness.worker():
        handle = await harness.start_supervisor(max_consecutive_failures=1)
        outcome = await handle.execute_update(SnapshotSupervisor.snapshot_now)
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    attempts = _lines(caplog, "temporalio.activity", phase="capture")
    assert len(attempts) == 3  # the harness's retry_attempts (FAST_RETRY)
    assert all(r.levelno == logging.WARNING for r in attempts)
    assert all((r.error_type, r.transient) == ("InjectedFault", True) for r in attempts)
    [failed] = _lines(caplog, "temporalio.workflow", status="failed")
    assert failed.levelno == logging.WARNING and failed.error_type == "InjectedFault"
    assert failed.checkpoint_id == outcome.checkpoint_id and failed.transient is True
    [gave_up] = _lines(caplog, "temporalio.workflow", consecutive_failures=1)
    assert gave_up.levelno == logging.ERROR and "the supervisor stops" in gave_up.getMessage()


async def test_a_restore_is_logged_by_its_workflow(
    harness: WorkflowHarness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="temporalio")
    async with harness.worker():
        assert (await harness.snapshot()).status == "published"
        plan = await harness.client.execute_workflow(
            RestoreRun.run,
            RestoreRequest(run_id=harness.run_id, restore_id="r-logged"),
            id=restore_workflow_id(harness.run_id, "r-logged"),
            task_queue=harness.task_queue,
        )
    [line] = _lines(caplog, "temporalio.workflow", restore_id="r-logged")
    assert line.levelno == logging.INFO and line.snapshot == plan.snapshot
    assert f"{len(plan.ready)} groups ready" in line.getMessage()
