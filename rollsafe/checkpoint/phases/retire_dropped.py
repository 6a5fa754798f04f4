"""Phase 3, retire_dropped: attempts the run abandoned (restarted, their group dropped) are
retired on the instances that held them, so their effects end there."""

from __future__ import annotations

from rollsafe.checkpoint.phases.context import PhaseContext
from rollsafe.core.phases import PhaseResult


def retire_dropped(ctx: PhaseContext) -> PhaseResult:
    participants, run = ctx.participants, ctx.run
    if participants is None:
        return ctx.result("no environment instances configured: nothing to retire")
    with run.barrier:
        retirements = run.state.ledger.retirements()
    count = participants.retire(retirements)
    with run.barrier:
        run.state.ledger.mark_retired(r.episode for r in retirements)
    return ctx.result(f"{count} abandoned attempts retired")
