"""RestoreRun: bring a run back from its newest snapshot that verifies (docs/design.md section 6).

Id ``rollsafe/{run_id}/restore/{restore_id}``. The controller selects, validates, loads the
data plane, restores the environments and engines (all or nothing across instances) and
applies each group's restart rule in one idempotent call (``restore_controller``). The plan
it returns says which groups come back ready, which partly, and in what order to redispatch
them. The restore ends with one line on ``workflow.logger``: the snapshot restored and the
plan's counts, or the failure's type.
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from rollsafe.core.phases import RestorePlan, RestoreRequest
    from rollsafe.temporal.search_attributes import KIND, PHASE, RUN_ID
    from rollsafe.workflows.models import PhaseOptions
    from rollsafe.workflows.snapshot import failure_type, start_activity

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
        try:
            plan = await start_activity(
                RESTORE_CONTROLLER_ACTIVITY, request, RestorePlan, PhaseOptions()
            )
        except ActivityError as exc:
            error_type, transient = failure_type(exc)
            workflow.logger.warning(
                "restore %s of run %s failed (%s): %s: %s",
                request.restore_id,
                request.run_id,
                "transient" if transient else "not transient",
                error_type,
                exc.cause or exc,
                extra={
                    "run_id": request.run_id,
                    "restore_id": request.restore_id,
                    "error_type": error_type,
                    "transient": transient,
                },
            )
            raise
        log_restored(request, plan)
        return plan


def log_restored(request: RestoreRequest, plan: RestorePlan) -> None:
    workflow.logger.info(
        "restore %s of run %s: restored %s (checkpoint %s, weight version %d): %d groups "
        "ready, %d partial, %d to redispatch, %d claims released, %d newer snapshots passed "
        "over, %d environment instances failed",
        request.restore_id,
        request.run_id,
        plan.snapshot,
        plan.checkpoint_id,
        plan.weight_version,
        len(plan.ready),
        len(plan.partial),
        len(plan.redispatch),
        len(plan.released_claims),
        len(plan.skipped),
        len(plan.environments_failed),
        extra={
            "run_id": request.run_id,
            "restore_id": request.restore_id,
            "snapshot": plan.snapshot,
            "checkpoint_id": plan.checkpoint_id,
        },
    )
