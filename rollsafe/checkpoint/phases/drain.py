"""Phase 5, drain: replies already on the wire (episodes that finished before the park) are
waited for, or, with the journal, left to seal into it after the capture."""

from __future__ import annotations

import logging

from rollsafe.checkpoint.participants import Participants
from rollsafe.checkpoint.phases.context import PhaseContext, few, ref_name
from rollsafe.core.phases import PhaseResult
from rollsafe.env.fleet_rules import FleetPrepared
from rollsafe.env.protocol import EpisodeRef

log = logging.getLogger("rollsafe.checkpoint.participants")


def drain(ctx: PhaseContext) -> PhaseResult:
    participants = ctx.participants
    if participants is None:
        return ctx.result("no environment instances configured: no replies on the wire to wait for")
    # With the journal a reply that lands after the capture is sealed into it, and a restore
    # replays it: waiting for it would only lengthen the park window.
    journaled = ctx.run.state.journal is not None
    prepared = ctx.record.require_prepared("drain")
    stragglers = wait_for_replies(participants, prepared, wait=not journaled)
    ctx.record.stragglers = stragglers
    summary = (
        f"{len(stragglers)} replies on the wire, not waited for (they seal into the journal)"
        if journaled
        else f"{len(stragglers)} replies still out after the drain (restarted)"
    )
    return ctx.result(summary, {"stragglers": len(stragglers)})


def wait_for_replies(
    participants: Participants, prepared: FleetPrepared, *, wait: bool = True
) -> list[EpisodeRef]:
    """Wait for the replies on the wire outside the commit scope (O(pending)). Those still out
    at the timeout are stragglers: not in the snapshot, so restarted after a restore from it
    alone. ``wait=False`` (the run keeps a journal, where each of them seals durably once it
    lands): none is waited for."""
    scope = {p.episode.key for inv in prepared.instances.values() for p in inv.parked}
    timeout_s = participants.options.drain_timeout_s if wait else 0.0

    async def outside() -> list[EpisodeRef]:
        return await participants.pending.wait_outside(scope, timeout_s)

    stragglers = participants.loop.run(outside())
    if stragglers and wait:
        cid = prepared.checkpoint_id
        log.warning(
            "checkpoint %s: %d replies still out after the %g s drain, left out of the "
            "snapshot (their rollouts restart after a restore): %s",
            cid,
            len(stragglers),
            timeout_s,
            few([ref_name(ref) for ref in stragglers]),
            extra={"checkpoint_id": cid, "stragglers": len(stragglers)},
        )
    return stragglers
