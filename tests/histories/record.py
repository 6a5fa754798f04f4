"""Record the golden workflow histories in this directory (run by hand, not by pytest):

    .venv/bin/python tests/histories/record.py            # every case
    .venv/bin/python tests/histories/record.py NAME ...   # only these (file stems)

Starts a Temporal dev server in a temporary directory, runs the checkpoint worker in this
process against an in-process controller (``LocalControllerClient`` over ``Controller``), drives
each case below and writes ``(await handle.fetch_history()).to_json()`` to ``NAME.json``.
Run ids and workflow ids are fixed so a re-recording differs only in timestamps, run ids
(UUIDs), attempt counts and similar. ``identity`` fields (``pid@hostname``) are replaced by
``IDENTITY``: replay never reads them, and the files should not carry this machine's name.

READ README.md FIRST: a committed history that stops replaying means the workflow change
needs ``workflow.patched(...)``, not a re-recording.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle

from rollsafe.activities.controllers import LocalControllerClient
from rollsafe.checkpoint.controller import Controller
from rollsafe.core.ids import snapshot_workflow_id, supervisor_id
from rollsafe.core.phases import Phase, SnapshotSpec
from rollsafe.dataplane import make_dataplane
from rollsafe.evidence.scenario import busy_run
from rollsafe.faults import arm, disarm_all
from rollsafe.snapshot import SnapshotStore
from rollsafe.temporal.connect import connect
from rollsafe.temporal.devserver import DevServer
from rollsafe.testing.waiting import eventually_async
from rollsafe.workers.checkpoint import build_worker
from rollsafe.workflows.models import PhaseOptions, SnapshotInput, SupervisorConfig, SupervisorInput
from rollsafe.workflows.snapshot import TRAINER_STATE_CHANGED, RolloutSnapshot
from rollsafe.workflows.supervisor import SnapshotSupervisor

HERE = Path(__file__).resolve().parent
IDENTITY = "rollsafe-history-recorder"
# Short retries: a failing phase gives up after 3 attempts within a second.
FAST = PhaseOptions(retry_initial_s=0.05, retry_maximum_s=0.2, retry_attempts=3)


class Case:
    """One recorded execution: a fresh run (controller, store, task queue, worker)."""

    def __init__(self, client: Client, root: Path, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self.task_queue = f"rollsafe.{run_id}"
        store = SnapshotStore(root / run_id, run_id)
        self.local = LocalControllerClient(
            Controller.from_parts(busy_run(run_id, make_dataplane("memory")), store)
        )

    def resolve(self, run_id: str) -> LocalControllerClient:
        assert run_id == self.run_id, run_id
        return self.local

    async def start_snapshot(
        self, seq: int = 1, participants: bool = True
    ) -> WorkflowHandle[Any, Any]:
        spec = SnapshotSpec(run_id=self.run_id, seq=seq)
        return await self.client.start_workflow(
            RolloutSnapshot.run,
            SnapshotInput(spec=spec, options=FAST, participants=participants),
            id=snapshot_workflow_id(self.run_id, seq),
            task_queue=self.task_queue,
        )

    async def start_supervisor(self, **config: Any) -> WorkflowHandle[Any, Any]:
        return await self.client.start_workflow(
            SnapshotSupervisor.run,
            SupervisorInput(config=SupervisorConfig(run_id=self.run_id, options=FAST, **config)),
            id=supervisor_id(self.run_id),
            task_queue=self.task_queue,
        )


async def snapshot_published(case: Case) -> WorkflowHandle[Any, Any]:
    handle = await case.start_snapshot()
    assert (await handle.result()).status == "published"
    return handle


async def snapshot_published_without_participants(case: Case) -> WorkflowHandle[Any, Any]:
    handle = await case.start_snapshot(participants=False)
    assert (await handle.result()).status == "published"
    return handle


async def snapshot_published_park_window_local(case: Case) -> WorkflowHandle[Any, Any]:
    """The park window's phases as local activities (patch ``park-window-local-activities``)."""
    return await snapshot_published(case)


async def in_phase(handle: WorkflowHandle[Any, Any], phase: Phase) -> bool:
    return bool((await handle.query(RolloutSnapshot.status)).phase == phase)


async def snapshot_skipped_before_capture(case: Case) -> WorkflowHandle[Any, Any]:
    """Aborted (update) while drain runs: drain's activity is cancelled, resume and
    abort_snapshot run, the outcome is skipped."""
    arm("phase.drain.before", "sleep:1.5")
    handle = await case.start_snapshot()
    await eventually_async(
        lambda: in_phase(handle, Phase.DRAIN), what="the snapshot in drain"
    )  # the recorded history has drain's activity cancelled: it must still be running
    await handle.execute_update(RolloutSnapshot.abort, "trainer step 7 committed")
    outcome = await handle.result()
    assert outcome.status == "skipped", outcome
    return handle


async def snapshot_published_past_step_committed(case: Case) -> WorkflowHandle[Any, Any]:
    """A rollout snapshot signalled ``trainer_state_changed`` while open runs (not a park-window
    phase: those run as local activities, and a query waits for their workflow task) publishes
    under the patch ``rollout-snapshot-outlives-steps``, the step in its status.
    ``snapshot_skipped_on_step_committed.json`` is the same drive recorded before the patch
    (skipped); this script can no longer record that one."""
    arm("phase.open.before", "sleep:1.5")
    handle = await case.start_snapshot()
    await eventually_async(lambda: in_phase(handle, Phase.OPEN), what="the snapshot in open")
    await handle.signal(TRAINER_STATE_CHANGED, 7)
    outcome = await handle.result()
    assert outcome.status == "published", outcome
    assert (await handle.query(RolloutSnapshot.status)).steps_committed == [7]
    return handle


async def snapshot_failed_after_retries(case: Case) -> WorkflowHandle[Any, Any]:
    arm("phase.capture.before", "raise")  # every attempt
    handle = await case.start_snapshot()
    outcome = await handle.result()
    assert outcome.status == "failed" and outcome.error_type == "InjectedFault", outcome
    return handle


async def snapshot_retried_then_published(case: Case) -> WorkflowHandle[Any, Any]:
    arm("phase.capture.before", "raise", times=2)  # attempt 3 of capture succeeds
    handle = await case.start_snapshot()
    assert (await handle.result()).status == "published"
    return handle


async def supervisor_two_requests_stopped(case: Case) -> WorkflowHandle[Any, Any]:
    """next_seq, two snapshot_now updates (two child snapshots, both published), an idle
    train_step_committed signal, then stop."""
    handle = await case.start_supervisor()
    for seq in (1, 2):
        outcome = await handle.execute_update(SnapshotSupervisor.snapshot_now)
        assert outcome.status == "published" and outcome.seq == seq, outcome
    await handle.signal(SnapshotSupervisor.train_step_committed, 5)
    await handle.signal(SnapshotSupervisor.stop)
    await handle.result()
    return handle


async def supervisor_too_many_failures(case: Case) -> WorkflowHandle[Any, Any]:
    arm("phase.capture.before", "raise")
    handle = await case.start_supervisor(max_consecutive_failures=2)
    for _ in range(2):
        outcome = await handle.execute_update(SnapshotSupervisor.snapshot_now)
        assert outcome.status == "failed", outcome
    with pytest.raises(WorkflowFailureError) as failed:
        await handle.result()
    assert "TooManyConsecutiveSnapshotFailures" in repr(failed.value.cause), failed.value.cause
    return handle


CASES: dict[str, Callable[[Case], Awaitable[WorkflowHandle[Any, Any]]]] = {
    fn.__name__: fn
    for fn in (
        snapshot_published,
        snapshot_published_without_participants,
        snapshot_published_park_window_local,
        snapshot_skipped_before_capture,
        snapshot_published_past_step_committed,
        snapshot_failed_after_retries,
        snapshot_retried_then_published,
        supervisor_two_requests_stopped,
        supervisor_too_many_failures,
    )
}


def scrub(node: Any) -> Any:
    """Replace every ``identity`` value (``pid@hostname``) with IDENTITY."""
    if isinstance(node, dict):
        return {k: IDENTITY if k == "identity" else scrub(v) for k, v in node.items()}
    if isinstance(node, list):
        return [scrub(v) for v in node]
    return node


async def record(names: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="rollsafe-histories-") as tmp:
        root = Path(tmp)
        async with DevServer(root / "temporal") as server:
            client = await connect(server.settings())
            for name in names:
                case = Case(client, root / "runs", f"golden-{name.replace('_', '-')}")
                try:
                    async with build_worker(client, case.task_queue, case.resolve):
                        handle = await CASES[name](case)
                    history = await handle.fetch_history()
                finally:
                    disarm_all()
                data = scrub(json.loads(history.to_json()))
                path = HERE / f"{name}.json"
                path.write_text(json.dumps(data, indent=2) + "\n")
                print(f"{path.relative_to(HERE.parent.parent)}: {len(data['events'])} events")
            await asyncio.sleep(0.1)  # sdk-python #300: let the workers' threads settle


def main(argv: list[str]) -> int:
    unknown = sorted(set(argv) - set(CASES))
    if unknown:
        print(f"unknown case(s) {unknown}; known: {sorted(CASES)}", file=sys.stderr)
        return 2
    # The injected faults fail activity attempts on purpose: no traceback per attempt.
    logging.getLogger("temporalio").setLevel(logging.ERROR)
    asyncio.run(record(argv or list(CASES)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
