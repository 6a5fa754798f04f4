"""Phase 6, cut_generation: the engines cut the calls of ``prefix``-level groups' parked
episodes and stage their prefixes in the data plane (rollsafe.engine.staging)."""

from __future__ import annotations

from rollsafe.checkpoint.phases.context import PhaseContext
from rollsafe.core.phases import PhaseResult
from rollsafe.observability import metrics


def cut_generation(ctx: PhaseContext) -> PhaseResult:
    participants = ctx.participants
    if participants is None:
        return ctx.result("no generation engines configured: nothing to cut")
    cut = participants.cut(ctx.checkpoint_id, ctx.run.state.dataplane, ctx.run.level_of)
    metrics.record_cut(ctx.spec.run_id, cut)
    outcomes = metrics.cut_outcomes(cut)
    summary = (
        f"{outcomes['cut']} calls cut and staged, {outcomes['skipped']} skipped "
        f"(finished, not started, or a coarser restore level), {outcomes['failed']} "
        "could not be cut (turn level)"
    )
    return ctx.result(summary, outcomes)
