"""Workflow logic whose timers run for hours, on Temporal's time-skipping test server
(rollsafe.testing.time_skipping): the supervisor's periodic snapshots over a day, anchors
handed to every later snapshot, the failure count across snapshots, and a snapshot's
compensation retried until it resumes. The real dev server runs the same workflows in
test_snapshot_workflow.py and test_client.py; here the parts a test does not exercise are
stand-ins (the snapshot workflow, the controller's activities)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
import pytest_asyncio
from temporalio import activity
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from rollsafe.core.ids import snapshot_workflow_id, supervisor_id
from rollsafe.core.phases import Phase, PhaseRequest, PhaseResult, SnapshotSpec
from rollsafe.testing.time_skipping import (
    FailingSnapshot,
    PublishingSnapshot,
    first_seq,
    start_time_skipping,
)
from rollsafe.workflows.models import (
    PhaseOptions,
    SnapshotInput,
    SupervisorConfig,
    SupervisorInput,
    SupervisorStatus,
)
from rollsafe.workflows.snapshot import ABORT_ACTIVITY, RolloutSnapshot
from rollsafe.workflows.supervisor import TOO_MANY_FAILURES, SnapshotSupervisor

HOUR = 3600.0
QUEUE = "time-skipping"


# One test server for the module, on the module's event loop.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env() -> AsyncIterator[WorkflowEnvironment]:
    environment = await start_time_skipping()
    try:
        yield environment
    finally:
        await environment.shutdown()


def worker(
    env: WorkflowEnvironment, workflows: Sequence[type], activities: Sequence[Any]
) -> Worker:
    return Worker(env.client, task_queue=QUEUE, workflows=workflows, activities=activities)


async def start_supervisor(env: WorkflowEnvironment, run_id: str, **config: Any) -> Any:
    request = SupervisorInput(config=SupervisorConfig(run_id=run_id, **config))
    return await env.client.start_workflow(
        SnapshotSupervisor.run, request, id=supervisor_id(run_id), task_queue=QUEUE
    )


async def status_of(handle: Any) -> SupervisorStatus:
    status: SupervisorStatus = await handle.query(SnapshotSupervisor.status)
    return status


def new_run() -> str:
    return f"ts-{uuid.uuid4().hex[:8]}"


async def test_a_day_of_hourly_snapshots_takes_a_day_of_snapshots(env: WorkflowEnvironment) -> None:
    run_id = new_run()
    async with worker(env, [SnapshotSupervisor, PublishingSnapshot], [first_seq]):
        handle = await start_supervisor(env, run_id, interval_s=HOUR)
        await env.sleep(24 * HOUR + 60)
        status = await status_of(handle)
        await handle.signal(SnapshotSupervisor.stop)
    assert (status.state.published, status.state.next_seq) == (24, 25)
    assert status.state.last_outcome is not None
    assert status.state.last_outcome.reason == "rollout anchor=None anchors=[]"


async def test_an_anchor_is_snapshotted_at_once_and_kept_by_every_later_one(
    env: WorkflowEnvironment,
) -> None:
    run_id = new_run()
    async with worker(env, [SnapshotSupervisor, PublishingSnapshot], [first_seq]):
        handle = await start_supervisor(env, run_id, interval_s=HOUR)
        anchored = await handle.execute_update(SnapshotSupervisor.trainer_checkpoint_snapshot, 5)
        await env.sleep(2 * HOUR + 60)
        status = await status_of(handle)
        await handle.signal(SnapshotSupervisor.stop)
    assert anchored.reason == "trainer anchor=5 anchors=[5]"
    assert status.state.published == 3  # the anchored one, then two periodic ones
    assert status.state.last_outcome is not None
    assert status.state.last_outcome.reason == "rollout anchor=None anchors=[5]"


async def test_failures_in_a_row_over_hours_end_the_supervisor_by_name(
    env: WorkflowEnvironment,
) -> None:
    run_id = new_run()
    async with worker(env, [SnapshotSupervisor, FailingSnapshot], [first_seq]):
        handle = await start_supervisor(env, run_id, interval_s=HOUR, max_consecutive_failures=3)
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()  # the server skips the three hours while this waits
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == TOO_MANY_FAILURES
    assert "3" in str(cause)


class Controller:
    """The phase activities of a snapshot, each answering at once but capture, which fails
    for good, and resume, which fails ``resume_failures`` times before it answers."""

    def __init__(self, resume_failures: int) -> None:
        self.calls: list[str] = []
        self.resume_failures = resume_failures

    def activities(self) -> list[Callable[..., Any]]:
        return [*(self._phase(phase) for phase in Phase), self._abort()]

    def _phase(self, phase: Phase) -> Callable[..., Any]:
        @activity.defn(name=phase.value)
        async def run(request: PhaseRequest) -> PhaseResult:
            self.calls.append(phase.value)
            if phase is Phase.CAPTURE:
                raise ApplicationError(
                    "ledger broken", type="LedgerInvariantViolation", non_retryable=True
                )
            if phase is Phase.RESUME and self.calls.count(phase.value) <= self.resume_failures:
                raise ApplicationError("controller unreachable", type="ControllerUnavailable")
            return PhaseResult(phase=phase, checkpoint_id=request.spec.checkpoint_id, summary="ok")

        return run

    def _abort(self) -> Callable[..., Any]:
        @activity.defn(name=ABORT_ACTIVITY)
        async def abort(spec: SnapshotSpec) -> PhaseResult:
            self.calls.append("abort")
            return PhaseResult(
                phase=Phase.RESUME, checkpoint_id=spec.checkpoint_id, summary="aborted"
            )

        return abort


async def test_a_failed_snapshot_resumes_through_its_retries_and_throws_its_draft_away(
    env: WorkflowEnvironment,
) -> None:
    """Compensation is retried until it resumes (admission must not stay closed): here the
    controller is unreachable for its first six tries, with the retry policy's backoff
    between them."""
    run_id, controller = new_run(), Controller(resume_failures=6)
    spec = SnapshotSpec(run_id=run_id, seq=1)
    # Backoffs past a minute: local activities wait them out on workflow timers, which skip.
    options = PhaseOptions(retry_initial_s=61, retry_maximum_s=600)
    async with worker(env, [RolloutSnapshot], controller.activities()):
        outcome = await env.client.execute_workflow(
            RolloutSnapshot.run,
            SnapshotInput(spec=spec, options=options),
            id=snapshot_workflow_id(run_id, 1),
            task_queue=QUEUE,
        )
    assert (outcome.status, outcome.error_type) == ("failed", "LedgerInvariantViolation")
    assert controller.calls[controller.calls.index("capture") :] == [
        "capture",
        *["resume"] * 7,
        "abort",
    ]
