"""Phase 2, close_admission: close the admission gate under a lease (rollsafe.core.gate): no
new attempt is dispatched until resume, or until the lease runs out with no phase renewing it."""

from __future__ import annotations

from rollsafe.checkpoint.phases.context import PhaseContext
from rollsafe.core.phases import PhaseResult


def close_admission(ctx: PhaseContext) -> PhaseResult:
    cid = ctx.checkpoint_id
    with ctx.ledger.lock:  # resume takes it too: it cannot slip between check and close
        ctx.ledger.refuse_if_resumed(
            ctx.record, "already resumed: it may not close admission again"
        )
        ctx.drafts.require(ctx.record)
        change = ctx.gate.close(cid, ctx.request.admission_lease_s)
    ctx.effect(change.changed)
    return ctx.result(f"admission {change.detail}")
