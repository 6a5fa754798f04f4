"""Phase 9, resume: the environments and engines go on and admission reopens, even when an
instance could not be reached (its park lease ends its park). Abort is resume that also throws
the draft away: both reopen through :func:`reopen`."""

from __future__ import annotations

from rollsafe.checkpoint.phase_ledger import ABORT
from rollsafe.checkpoint.phases.context import PhaseContext
from rollsafe.core.gate import GateChange
from rollsafe.core.phases import Phase, PhaseResult
from rollsafe.observability import metrics


def resume(ctx: PhaseContext) -> PhaseResult:
    resumed, change = reopen(ctx, count=True)
    return ctx.result(f"{resumed}admission {change.detail}")


def abort(ctx: PhaseContext) -> PhaseResult:
    """Discard the draft, if any, and reopen the gate; stored results are kept. ``ctx`` is
    for phase resume (the result abort stores)."""
    resumed, change = reopen(ctx, count=False)
    entry = ctx.drafts.entry(ctx.checkpoint_id)
    if entry is not None:
        ctx.drafts.discard(entry, "aborted")  # for a phase that found the entry before abort
    discarded = "draft discarded" if entry else "no draft to discard"
    ctx.ledger.count(ABORT, entry is not None or change.changed)
    return ctx.result(f"aborted: {discarded}; {resumed}admission {change.detail}")


def reopen(ctx: PhaseContext, *, count: bool) -> tuple[str, GateChange]:
    """Mark the checkpoint resumed (it may never close the gate or open again), resume the
    participants and reopen admission, whatever the participants answered; ``count``: the
    reopening is resume's effect (counted even when a participant failed: a retry finds the
    gate open)."""
    cid = ctx.checkpoint_id
    ctx.ledger.mark_resumed(ctx.record)
    try:
        resumed = _resume_participants(ctx)
    finally:
        with ctx.ledger.lock:
            change = ctx.gate.open(cid)
        metrics.admission_reopened(ctx.spec.run_id, change)
        if count:
            ctx.ledger.count(Phase.RESUME, change.changed)
    return resumed, change


def _resume_participants(ctx: PhaseContext) -> str:
    participants = ctx.participants
    if participants is None:
        return ""
    resumed = participants.resume(ctx.checkpoint_id)
    entry = ctx.drafts.entry(ctx.checkpoint_id)
    if entry is None or entry.capture is None:  # else they go once the capture is written
        ctx.drafts.drop_staged()
    return resumed + "; "
