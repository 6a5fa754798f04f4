"""Replay the committed golden histories (tests/histories/*.json) against today's workflow code.

Offline: no server, no worker, no activities. A workflow change that makes a committed history
fail here would break every execution of that shape still running in production at deploy
time; guard it with ``workflow.patched(...)`` (tests/histories/README.md), never re-record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from rollsafe.core.phases import PhaseResult
from rollsafe.temporal.converter import data_converter
from rollsafe.workflows.models import SnapshotInput, SnapshotOutcome, SupervisorInput
from rollsafe.workflows.snapshot import RolloutSnapshot, start_activity
from rollsafe.workflows.supervisor import SnapshotSupervisor

HISTORIES = Path(__file__).resolve().parents[1] / "histories"
FILES = sorted(HISTORIES.glob("*.json"))
WORKFLOWS = [SnapshotSupervisor, RolloutSnapshot]


def _started(path: Path) -> dict[str, Any]:
    started: dict[str, Any] = json.loads(path.read_text())["events"][0][
        "workflowExecutionStartedEventAttributes"
    ]
    return started


def load(path: Path) -> WorkflowHistory:
    """The history with the workflow id it ran under (recorded in its start event)."""
    return WorkflowHistory.from_json(_started(path)["workflowId"], path.read_text())


def workflow_type(path: Path) -> str:
    name: str = _started(path)["workflowType"]["name"]
    return name


@pytest.fixture(scope="module")
def replayer() -> Replayer:
    return Replayer(workflows=WORKFLOWS, data_converter=data_converter)


def test_every_workflow_type_has_a_golden_history() -> None:
    """So the replay test below cannot pass by having nothing to replay."""
    recorded = {workflow_type(path) for path in FILES}
    wanted = {str(workflow._Definition.must_from_class(cls).name) for cls in WORKFLOWS}
    assert wanted <= recorded, f"no golden history in {HISTORIES} for {sorted(wanted - recorded)}"


@pytest.mark.parametrize("path", FILES, ids=[path.stem for path in FILES])
async def test_golden_history_replays(replayer: Replayer, path: Path) -> None:
    result = await replayer.replay_workflow(load(path), raise_on_replay_failure=False)
    failure = result.replay_failure
    if failure is not None:
        pytest.fail(
            f"{path.relative_to(HISTORIES.parent.parent)} no longer replays "
            f"({type(failure).__name__}: {failure}). If this workflow change is intended, "
            "guard it with workflow.patched(...) (tests/histories/README.md); do not re-record.",
            pytrace=False,
        )


# Workflow changes as a careless edit would make them: one extra activity before the first
# step, under the same workflow type name. Unsandboxed: to validate a sandboxed class the
# sandbox re-imports its module, and this test module does not survive that (module-level
# Path.resolve is restricted in there).
EXTRA_ACTIVITY = "verify_trainer_idle"


@workflow.defn(name="RolloutSnapshot", sandboxed=False)
class RolloutSnapshotWithExtraStep(RolloutSnapshot):
    @workflow.run
    async def run(self, request: SnapshotInput) -> SnapshotOutcome:
        await start_activity(EXTRA_ACTIVITY, request.spec, PhaseResult, request.options)
        return await super().run(request)


@workflow.defn(name="SnapshotSupervisor", sandboxed=False)
class SnapshotSupervisorWithExtraStep(SnapshotSupervisor):
    @workflow.run
    async def run(self, request: SupervisorInput) -> None:
        config = request.config
        await start_activity(EXTRA_ACTIVITY, config.run_id, int, config.options)
        await super().run(request)


# The same change done right: guarded by a patch, so histories recorded without it replay.
@workflow.defn(name="RolloutSnapshot", sandboxed=False)
class RolloutSnapshotWithPatchedStep(RolloutSnapshot):
    @workflow.run
    async def run(self, request: SnapshotInput) -> SnapshotOutcome:
        if workflow.patched("verify-trainer-idle"):
            await start_activity(EXTRA_ACTIVITY, request.spec, PhaseResult, request.options)
        return await super().run(request)


@pytest.mark.parametrize(
    ("variant", "path"),
    [
        (RolloutSnapshotWithExtraStep, HISTORIES / "snapshot_published.json"),
        (SnapshotSupervisorWithExtraStep, HISTORIES / "supervisor_two_requests_stopped.json"),
    ],
    ids=["snapshot", "supervisor"],
)
async def test_an_unversioned_change_fails_replay(variant: type, path: Path) -> None:
    """The replay test can fail: the altered workflow does not replay a golden history."""
    altered = Replayer(workflows=[variant], data_converter=data_converter)
    with pytest.raises(workflow.NondeterminismError, match="TMPRL1100"):
        await altered.replay_workflow(load(path))


async def test_the_same_change_behind_a_patch_replays() -> None:
    patched = Replayer(workflows=[RolloutSnapshotWithPatchedStep], data_converter=data_converter)
    paths = [path for path in FILES if workflow_type(path) == "RolloutSnapshot"]
    assert paths
    for path in paths:
        result = await patched.replay_workflow(load(path), raise_on_replay_failure=False)
        assert result.replay_failure is None, f"{path.name}: {result.replay_failure}"
