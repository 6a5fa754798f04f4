"""The trainer SDK against a real Temporal dev server and a real worker, the controller in
this process (the harness of test_snapshot_workflow.py, copied: test modules are not
importable from each other in importlib mode)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any, cast

import pytest
from temporalio.client import (
    Client,
    Interceptor,
    OutboundInterceptor,
    WorkflowExecutionStatus,
)

from rollsafe.client import Checkpointer, SyncCheckpointer
from rollsafe.core.phases import Phase
from rollsafe.errors import (
    CheckpointTimeout,
    InvalidInput,
    RestoreFailed,
    SnapshotsFailed,
    SupervisorNotRunning,
)
from rollsafe.faults import arm, disarm_all
from rollsafe.settings import Settings
from rollsafe.temporal.devserver import DevServer
from rollsafe.testing.waiting import eventually_async, holding
from rollsafe.workflows.models import (
    PhaseOptions,
    SnapshotOutcome,
    SupervisorInput,
    SupervisorStatus,
)
from rollsafe.workflows.snapshot import TRAINER_STATE_CHANGED, RolloutSnapshot
from rollsafe.workflows.supervisor import SnapshotSupervisor

if TYPE_CHECKING:
    from tests.integration.conftest import WorkflowHarness

# As the harness's (conftest.FAST_RETRY): the update and query reach a held local-activity
# phase at the workflow task's heartbeat, 80 % of task_timeout_s.
FAST = PhaseOptions(retry_initial_s=0.05, retry_maximum_s=0.2, retry_attempts=3, task_timeout_s=2.0)


def checkpointer(
    harness: WorkflowHarness, max_consecutive_failures: int = 3, client: Client | None = None
) -> Checkpointer:
    return Checkpointer(
        harness.run_id,
        client=client or harness.client,
        options=FAST,
        max_consecutive_failures=max_consecutive_failures,
    )


class CountingCalls(Interceptor):
    """Counts the client's calls by kind (describe, signal, query, ...): what the SDK costs."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        calls = self.calls

        class Counting(OutboundInterceptor):
            async def describe_workflow(self, input: Any) -> Any:
                calls["describe"] += 1
                return await super().describe_workflow(input)

            async def signal_workflow(self, input: Any) -> None:
                calls["signal"] += 1
                await super().signal_workflow(input)

        return Counting(next)


def counted(client: Client) -> tuple[Client, CountingCalls]:
    counter = CountingCalls()
    return Client(**(client.config() | {"interceptors": [counter]})), counter


async def test_start_twice_attaches_and_snapshot_now_publishes(harness: WorkflowHarness) -> None:
    async with harness.worker():
        ckpt = await checkpointer(harness).start()
        first = await harness.client.get_workflow_handle(ckpt.workflow_id).describe()
        restarted = await checkpointer(harness, max_consecutive_failures=5).start()
        again = await harness.client.get_workflow_handle(ckpt.workflow_id).describe()
        assert again.run_id == first.run_id  # the restarted trainer attached, no new run
        # cast: mypy refuses the value of a call typed to return None, which this checks.
        assert cast(object, await restarted.train_step_committed(3)) is None
        # The controller is at weight version 0: a checkpoint of it anchors a snapshot.
        await restarted.trainer_checkpoint_saved(0, "/ckpt/v0")
        assert restarted.saved_checkpoints == {0: "/ckpt/v0"}
        await eventually_async(lambda: _published(ckpt, 1), what="the anchored snapshot published")
        outcome = await ckpt.snapshot_now()
        assert outcome.status == "published" and outcome.seq == 2, outcome.reason
        status = await supervisor_status(ckpt)
        assert status.state.published == 2 and status.state.failed == 0
        assert status.state.last_committed_step == 3 and status.running_seq is None
        assert status.state.anchors == [0]
        await ckpt.stop()
        await harness.client.get_workflow_handle(ckpt.workflow_id).result()
        plan = await ckpt.restore("after-stop")
    assert plan.checkpoint_id == outcome.checkpoint_id
    with pytest.raises(SupervisorNotRunning, match=r"COMPLETED.*start\(\)"):
        await ckpt.status()


async def supervisor_status(ckpt: Checkpointer) -> SupervisorStatus:
    # status() asks the supervisor only once the server lists a worker's poll, which it does
    # a moment after the worker starts (CI once asked before).
    await eventually_async(lambda: _present(ckpt), what="the supervisor present")
    status = await ckpt.status()
    assert status.supervisor is not None, status.warnings
    return status.supervisor


async def _published(ckpt: Checkpointer, count: int) -> bool:
    return (await supervisor_status(ckpt)).state.published >= count


async def _steps_noted(harness: WorkflowHarness, seq: int) -> list[int]:
    handle = harness.client.get_workflow_handle(harness.snapshot_workflow_id(seq))
    noted: list[int] = (await handle.query(RolloutSnapshot.status)).steps_committed
    return noted


async def test_a_step_committed_before_capture_is_in_the_rollout_snapshot(
    harness: WorkflowHarness,
) -> None:
    """The capture, under the barrier, records the state after the step: the snapshot is not
    discarded (issue 35: under load, none would ever publish). A step committed after
    capture changes nothing either."""
    async with harness.worker():
        ckpt = await checkpointer(harness).start()
        with holding("phase.drain.before") as drain:
            pending = asyncio.create_task(ckpt.snapshot_now())
            await drain.reached_async()  # snapshot 1 stands in its drain until released
            assert await harness.snapshot_phase(1) == Phase.DRAIN
            harness.controller.set_weight_version(1)  # the trainer's step, on the controller
            await ckpt.train_step_committed(1)
            await eventually_async(
                lambda: _steps_noted(harness, 1), what="snapshot 1 told of step 1 in its drain"
            )
            assert await _abort_reason(harness, 1) is None
        outcome = await pending
        assert outcome.status == "published" and outcome.published is not None
        assert outcome.published.weight_version == 1  # captured after the step
        assert harness.controller.status().gate_open

        with holding("phase.publish.before") as publish:
            pending = asyncio.create_task(ckpt.snapshot_now())
            await publish.reached_async()
            assert await harness.snapshot_phase(2) == Phase.PUBLISH
            await ckpt.train_step_committed(2)  # captured already
            await eventually_async(
                lambda: _signalled(harness, 2, TRAINER_STATE_CHANGED),
                what="snapshot 2 told of step 2 in its publish",
            )
        assert (await pending).status == "published"
        assert await _steps_noted(harness, 2) == []
        status = await supervisor_status(ckpt)
        assert (status.state.skipped, status.state.published) == (0, 2)
        assert status.state.last_committed_step == 2


async def test_a_step_committed_before_an_anchored_capture_aborts_it(
    harness: WorkflowHarness,
) -> None:
    """An anchored snapshot captures at its anchor's weight version or not at all: a step
    before its capture aborts it at once instead of failing in capture."""
    async with harness.worker():
        ckpt = await checkpointer(harness).start()
        with holding("phase.drain.before") as drain:
            await ckpt.trainer_checkpoint_saved(0, "/ckpt/v0")
            await drain.reached_async()
            assert await harness.snapshot_phase(1) == Phase.DRAIN
            harness.controller.set_weight_version(1)
            await ckpt.train_step_committed(1)
            await eventually_async(
                lambda: _abort_reason(harness, 1), what="snapshot 1 told to abort in its drain"
            )
        snapshot_id = harness.snapshot_workflow_id(1)
        handle = harness.client.get_workflow_handle(snapshot_id, result_type=SnapshotOutcome)
        outcome = await handle.result()
        assert outcome.status == "skipped" and "step 1 committed" in outcome.reason
        assert harness.store.list() == [] and harness.controller.status().gate_open


async def test_a_trainer_snapshot_past_its_anchor_is_skipped_not_published(
    harness: WorkflowHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint of weight version 4 while the controller is at 0 (a step committed before
    the anchored snapshot could capture looks the same): no snapshot at the wrong version.
    An outcome the design expects: logged as one INFO line, no traceback, no WARNING."""
    caplog.set_level(logging.DEBUG, logger="temporalio")
    async with harness.worker():
        ckpt = await checkpointer(harness).start()
        await ckpt.trainer_checkpoint_saved(4, "/ckpt/v4")
        outcome = await ckpt.snapshot_now()  # queued after the anchored one
        assert outcome.status == "published" and outcome.published is not None
        assert outcome.published.weight_version == 0
        status = await supervisor_status(ckpt)
        assert (status.state.skipped, status.state.failed, status.state.published) == (1, 0, 1)
    names = [entry.name for entry in harness.store.list()]
    assert names == ["00000002-rollout"]  # nothing of the trainer snapshot, seq 1
    passed = [r for r in caplog.records if "AnchorPassed" in r.getMessage()]
    assert passed and all(r.levelno <= logging.INFO and not r.exc_info for r in passed)


async def _abort_reason(harness: WorkflowHarness, seq: int) -> str | None:
    handle = harness.client.get_workflow_handle(harness.snapshot_workflow_id(seq))
    reason: str | None = (await handle.query(RolloutSnapshot.status)).abort_reason
    return reason


async def _signalled(harness: WorkflowHarness, seq: int, signal: str) -> bool:
    """Whether snapshot ``seq``'s history holds ``signal``: it is then handled before anything
    that comes after it (an activity completing once released)."""
    handle = harness.client.get_workflow_handle(harness.snapshot_workflow_id(seq))
    async for event in handle.fetch_history_events():
        # Empty (no signal name) on any other kind of event.
        if event.workflow_execution_signaled_event_attributes.signal_name == signal:
            return True
    return False


async def test_persistent_failures_surface_as_snapshots_failed(harness: WorkflowHarness) -> None:
    arm("phase.capture.before", "raise")
    async with harness.worker():
        ckpt = await checkpointer(harness, max_consecutive_failures=2).start()
        assert (await ckpt.snapshot_now()).status == "failed"
        assert (await supervisor_status(ckpt)).state.consecutive_failures == 1
        assert (await ckpt.snapshot_now()).status == "failed"
        for call in (ckpt.status, lambda: ckpt.train_step_committed(9)):
            with pytest.raises(SnapshotsFailed, match="TooManyConsecutiveSnapshotFailures"):
                await call()
        with pytest.raises(SnapshotsFailed) as failed:
            await ckpt.snapshot_now()
        assert failed.value.failure_type == "TooManyConsecutiveSnapshotFailures"
        assert "InjectedFault" in str(failed.value)  # the last failure's message
        # A restarted trainer starts checkpointing again.
        disarm_all()
        await ckpt.start()
        assert (await ckpt.snapshot_now()).status == "published"
        await ckpt.stop()
    assert harness.controller.status().gate_open


async def test_snapshot_now_timeout_raises_and_the_snapshot_goes_on(
    harness: WorkflowHarness,
) -> None:
    async with harness.worker():
        ckpt = await checkpointer(harness).start()
        with pytest.raises(CheckpointTimeout, match=r"within 0\.001 s"):
            await ckpt.snapshot_now(timeout=0.001)
        with holding("phase.drain.before") as drain:
            # Accepted, then timed out: held in its drain, the snapshot cannot finish in time.
            with pytest.raises(CheckpointTimeout):
                await ckpt.snapshot_now(timeout=0.3)
            await drain.reached_async()  # it goes on: it got to its drain
        await eventually_async(lambda: _published(ckpt, 1), what="snapshot 1 published")
        await ckpt.stop()


async def test_a_call_without_a_supervisor_says_to_call_start(harness: WorkflowHarness) -> None:
    never_started = Checkpointer(harness.run_id)
    with pytest.raises(SupervisorNotRunning, match=r"start\(\) first"):
        await never_started.status()
    with pytest.raises(SupervisorNotRunning, match=r"no checkpoint supervisor.*start\(\)"):
        await checkpointer(harness).train_step_committed(1)
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(InvalidInput, match="a step is an integer >= 0"):
            await checkpointer(harness).train_step_committed(bad)  # type: ignore[arg-type]


async def test_without_a_worker_calls_answer_instead_of_hanging(harness: WorkflowHarness) -> None:
    ckpt = checkpointer(harness)
    ckpt.worker_timeout_s = 0.5
    async with harness.worker():
        await ckpt.start()
        await supervisor_status(ckpt)  # the supervisor has run its first task
    await asyncio.sleep(0.1)  # sdk-python #300
    status = await ckpt.status()  # answers, and says why it has no supervisor status
    assert status.supervisor is None and len(status.warnings) == 1
    # Whether the server still lists the stopped worker's last poll depends on the server.
    assert "no checkpoint worker" in status.warnings[0], status.warnings
    await ckpt.train_step_committed(2)  # a signal: no worker needed


async def test_a_run_no_worker_serves_is_reported_once_and_in_status(
    harness: WorkflowHarness, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = checkpointer(harness)
    ckpt.worker_check_every_s = 0.0  # every step looks (the default: every 30 s)
    with caplog.at_level(logging.WARNING, logger="rollsafe.client"):
        await ckpt.start()
        for step in range(3):
            await ckpt.train_step_committed(step)
    absent = [r.getMessage() for r in caplog.records if "no checkpoint worker polls" in r.message]
    assert len(absent) == 1 and harness.task_queue in absent[0], caplog.text
    status = await ckpt.status()
    assert not status.workers.present and status.workers.newest_poll_age_s is None
    assert status.supervisor is None and "no worker has ever polled" in status.warnings[0]

    async with harness.worker():
        await eventually_async(lambda: _present(ckpt), what="the supervisor present")
        caplog.clear()
        await ckpt.train_step_committed(3)
        assert (await supervisor_status(ckpt)).state.last_committed_step == 3
    assert "no checkpoint worker" not in caplog.text


async def _present(ckpt: Checkpointer) -> bool:
    return (await ckpt.workers()).present


async def test_train_step_committed_is_one_signal(harness: WorkflowHarness) -> None:
    client, counter = counted(harness.client)
    async with harness.worker():
        ckpt = await checkpointer(harness, client=client).start()
        counter.calls.clear()
        for step in range(5):
            await ckpt.train_step_committed(step)
        await ckpt.trainer_checkpoint_saved(5, "/ckpt/5")
    assert counter.calls == {"signal": 6}  # no describe, no worker waited for


async def test_restore_without_a_snapshot_raises_restore_failed(harness: WorkflowHarness) -> None:
    ckpt = Checkpointer(harness.run_id, client=harness.client, task_queue=harness.task_queue)
    async with harness.worker():
        with pytest.raises(RestoreFailed, match="NoValidSnapshot: no snapshot under"):
            await ckpt.restore("first")


async def test_the_sync_sdk_makes_the_same_calls_with_the_same_errors(
    harness: WorkflowHarness, server: DevServer
) -> None:
    """SyncCheckpointer, configured from one settings mapping (run id, Temporal, phases), as
    a synchronous training loop holds it; called from threads here, because the harness's
    worker runs on this test's event loop."""
    connection = server.settings()
    settings = Settings.load(
        {
            "run_id": harness.run_id,
            "temporal": {"address": connection.address, "namespace": connection.namespace},
            "phases": FAST.model_dump(),
        },
        env={},
    )
    with SyncCheckpointer(settings=settings) as ckpt:
        assert ckpt.checkpointer.config.options == FAST
        with pytest.raises(SupervisorNotRunning, match=r"start\(\) first"):
            await asyncio.to_thread(ckpt.train_step_committed, 0)
        async with harness.worker():
            await asyncio.to_thread(ckpt.start)
            await asyncio.to_thread(ckpt.trainer_checkpoint_saved, 0, "/ckpt/v0")
            outcome = await asyncio.to_thread(ckpt.snapshot_now, 60)
            assert outcome.status == "published", outcome.reason
            with pytest.raises(InvalidInput, match="a step is an integer"):
                await asyncio.to_thread(ckpt.train_step_committed, -1)
            status = await asyncio.to_thread(ckpt.status)
            assert status.supervisor is not None and status.supervisor.state.published >= 1
            await asyncio.to_thread(ckpt.stop)


async def test_a_waited_trainer_checkpoint_is_one_snapshot_at_its_version(
    harness: WorkflowHarness,
) -> None:
    """trainer_checkpoint_saved(wait=True) answers with the anchored snapshot itself: no
    second snapshot is needed to be sure of one at the checkpoint's weight version; stop with
    wait returns once the supervisor has ended."""
    async with harness.worker():
        ckpt = await checkpointer(harness).start()
        outcome = await ckpt.trainer_checkpoint_saved(0, "/ckpt/v0", wait=True, timeout=60)
        assert outcome is not None and outcome.status == "published", outcome
        assert outcome.published is not None and outcome.published.weight_version == 0
        assert ckpt.saved_checkpoints == {0: "/ckpt/v0"}
        status = await supervisor_status(ckpt)
        assert (status.state.published, status.state.anchors) == (1, [0])
        await ckpt.stop(wait=True, timeout=60)
        handle = harness.client.get_workflow_handle(ckpt.workflow_id)
        assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED


async def test_a_notice_that_starts_the_supervisor_is_not_lost(harness: WorkflowHarness) -> None:
    """A signal delivered with the supervisor's start (signal-with-start, as a restarted
    trainer's held anchors are) is handled before run() begins: the supervisor's state must
    already exist then, or run() would overwrite what the signal did."""
    ckpt = checkpointer(harness)
    async with harness.worker():
        await harness.client.start_workflow(
            SnapshotSupervisor.run,
            SupervisorInput(config=ckpt.config),
            id=ckpt.workflow_id,
            task_queue=ckpt.task_queue,
            start_signal="trainer_checkpoint_saved",
            start_signal_args=[0],
        )
        await eventually_async(lambda: _published(ckpt, 1), what="the anchored snapshot")
        assert (await supervisor_status(ckpt)).state.anchors == [0]
        await ckpt.stop()
