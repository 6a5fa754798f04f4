"""RestoreRun: bring a run back from its newest snapshot that verifies (docs/design.md section 6).

Id ``rollsafe/{run_id}/restore/{restore_id}``. The controller selects, validates, loads the
data plane, restores the environments and engines (all or nothing across instances) and
applies each group's restart rule in one idempotent call (``restore_controller``). The plan
it returns says which groups come back ready, which partly, and in what order to redispatch
them.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from rollsafe.core.phases import RestorePlan, RestoreRequest
    from rollsafe.temporal.search_attributes import KIND, PHASE, RUN_ID
    from rollsafe.workflows.models import PhaseOptions
    from rollsafe.workflows.snapshot import start_activity

RESTORE_CONTROLLER_ACTIVITY = "restore_controller"


@workflow.defn(name="RestoreRun")
class RestoreRun:
    @workflow.run
    async def run(self, request: RestoreRequest) -> RestorePlan:
        workflow.upsert_search_attributes(
            [
                RUN_ID.value_set(request.run_id),
                KIND.value_set("restore"),
                PHASE.value_set(RESTORE_CONTROLLER_ACTIVITY),
            ]
        )
        workflow.set_current_details(f"restore {request.restore_id} of run {request.run_id}")
        # A corrupt or missing snapshot is an invariant error: not retried, the run refuses
        # to start with the message naming what is wrong (invariant 7).
        return await start_activity(
            RESTORE_CONTROLLER_ACTIVITY, request, RestorePlan, PhaseOptions()
        )
