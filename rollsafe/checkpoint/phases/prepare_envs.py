"""Phase 4, prepare_envs: every environment instance parks its episodes at a turn boundary
(docs/environment-protocol.md), under a park lease the admission lease's heartbeats renew."""

from __future__ import annotations

from rollsafe.checkpoint.phases.context import PhaseContext
from rollsafe.core.phases import PhaseResult


def prepare_envs(ctx: PhaseContext) -> PhaseResult:
    participants = ctx.participants
    if participants is None:
        return ctx.result("no environment instances configured: nothing to park")
    prepared = participants.prepare(ctx.checkpoint_id)
    parked = sum(len(i.parked) for i in prepared.instances.values())
    restarts = sum(len(i.restarts) for i in prepared.instances.values())
    summary = f"{len(prepared.instances)} instances parked {parked} episodes"
    return ctx.result(f"{summary}, {restarts} to restart", {"parked": parked})
