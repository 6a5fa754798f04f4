"""Phase 5, drain: replies already on the wire (episodes that finished before the park) are
waited for, or, with the journal, left to seal into it after the capture."""

from __future__ import annotations

from rollsafe.checkpoint.phases.context import PhaseContext
from rollsafe.core.phases import PhaseResult


def drain(ctx: PhaseContext) -> PhaseResult:
    participants = ctx.participants
    if participants is None:
        return ctx.result("no environment instances configured: no replies on the wire to wait for")
    # With the journal a reply that lands after the capture is sealed into it, and a restore
    # replays it: waiting for it would only lengthen the park window.
    journaled = ctx.run.state.journal is not None
    stragglers = participants.drain(ctx.checkpoint_id, wait=not journaled)
    summary = (
        f"{len(stragglers)} replies on the wire, not waited for (they seal into the journal)"
        if journaled
        else f"{len(stragglers)} replies still out after the drain (restarted)"
    )
    return ctx.result(summary, {"stragglers": len(stragglers)})
