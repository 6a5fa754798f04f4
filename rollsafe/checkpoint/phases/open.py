"""Phase 1, open: begin the checkpoint's draft in the snapshot store."""

from __future__ import annotations

from rollsafe.checkpoint.phases.context import PhaseContext, storage_errors
from rollsafe.core.phases import PhaseResult


def open_draft(ctx: PhaseContext) -> PhaseResult:
    cid = ctx.checkpoint_id
    stale = ctx.drafts.open
    if stale is not None and ctx.gate.expired(stale.spec.checkpoint_id) is not None:
        ctx.drafts.abandon(stale)  # no phase of it came back to notice: never publishable
    with ctx.ledger.lock, storage_errors(cid, "opening its draft"):
        ctx.run.check_fence(f"checkpoint {cid}")
        # A stray late attempt would hold a draft nobody finishes.
        ctx.ledger.refuse_if_resumed(ctx.record, "already ended: it may not open again")
        entry = ctx.drafts.begin(ctx.spec)
    return ctx.result(f"draft {entry.draft.path.name} open")
