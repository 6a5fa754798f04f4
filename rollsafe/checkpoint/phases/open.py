"""Phase 1, open: begin the checkpoint's draft in the snapshot store."""

from __future__ import annotations

from rollsafe.checkpoint.phases.context import PhaseContext, storage_errors
from rollsafe.core.phases import PhaseResult


def open_draft(ctx: PhaseContext) -> PhaseResult:
    cid = ctx.checkpoint_id
    # A draft that can never be published (no phase of it came back to notice) goes first.
    ctx.drafts.reclaim(ctx.gate, ctx.record)
    with storage_errors(cid, "opening its draft"):
        ctx.store.sweep()  # drafts of crashed writers: deletes, so not under the ledger's lock
        with ctx.ledger.lock:
            ctx.run.check_fence(f"checkpoint {cid}")
            # A stray late attempt would hold a draft nobody finishes.
            ctx.ledger.refuse_if_resumed(ctx.record, "already ended: it may not open again")
            record = ctx.drafts.begin(ctx.record, ctx.request.admission_lease_s)
    return ctx.result(f"draft {record.files.path.name} open")
