"""Phase 4, prepare_envs: every environment instance parks its episodes at a turn boundary
(docs/environment-protocol.md), under a park lease the admission lease's heartbeats renew
(:func:`renew_park`)."""

from __future__ import annotations

import concurrent.futures
import logging
import time

from rollsafe.checkpoint.participants import Participants
from rollsafe.checkpoint.phases.context import PhaseContext, few, ref_name, spent_if_resumed
from rollsafe.checkpoint.record import CheckpointRecord
from rollsafe.core.phases import PhaseResult
from rollsafe.env.fleet_rules import FleetPrepared

log = logging.getLogger("rollsafe.checkpoint.participants")


def prepare_envs(ctx: PhaseContext) -> PhaseResult:
    participants = ctx.participants
    if participants is None:
        return ctx.result("no environment instances configured: nothing to park")
    prepared = park(participants, ctx.checkpoint_id)
    ctx.record.prepared, ctx.record.renewed_at = prepared, time.monotonic()
    parked = sum(len(i.parked) for i in prepared.instances.values())
    restarts = sum(len(i.restarts) for i in prepared.instances.values())
    summary = f"{len(prepared.instances)} instances parked {parked} episodes"
    return ctx.result(f"{summary}, {restarts} to restart", {"parked": parked})


def park(participants: Participants, checkpoint_id: str) -> FleetPrepared:
    """Every instance parks at a turn boundary (or none stays parked)."""
    deadline = time.time() + participants.options.park_deadline_s
    # An earlier attempt failed on one instance and resumed the others: they refuse this
    # id forever. Not the run's fault: the next snapshot, under a new id, can.
    with spent_if_resumed(checkpoint_id, "an earlier prepare failed and resumed them"):
        prepared = participants.loop.run(participants.fleet.prepare_all(checkpoint_id, deadline))
    _log_prepared(prepared)
    return prepared


def renew_park(
    participants: Participants, record: CheckpointRecord
) -> concurrent.futures.Future[None] | None:
    """Extend the park lease of ``record``'s instances to the park deadline from now, in the
    background: the admission lease's heartbeats call this, so a park window that outlives
    the park deadline holds while its snapshot's worker lives (once they stop, the lease
    ends the park by itself). At most one renewal in flight, and one per quarter of the
    deadline; None when none started (not parked, or renewed recently). Heartbeats race here
    harmlessly: at worst two renewals go out."""
    deadline_s, now = participants.options.park_deadline_s, time.monotonic()
    if record.prepared is None:
        return None
    if record.renewing is not None and not record.renewing.done():
        return None
    if now - record.renewed_at < deadline_s / 4:
        return None
    record.renewed_at = now
    renewal = _renew(participants, record.checkpoint_id, time.time() + deadline_s)
    record.renewing = participants.loop.submit(renewal)
    return record.renewing


async def _renew(participants: Participants, checkpoint_id: str, deadline_ts: float) -> None:
    try:
        await participants.fleet.renew_all(checkpoint_id, deadline_ts)
    except Exception as exc:  # the next heartbeat tries again; a lost lease fails commit
        log.warning(
            "checkpoint %s: renewing the environments' park lease failed (%s: %s); the "
            "next heartbeat tries again",
            checkpoint_id,
            type(exc).__name__,
            exc,
            extra={"checkpoint_id": checkpoint_id},
        )


def _log_prepared(prepared: FleetPrepared) -> None:
    """Per instance: what it parked (DEBUG), and episodes it could not park, which restart."""
    cid = prepared.checkpoint_id
    for name, inventory in sorted(prepared.instances.items()):
        log.debug("checkpoint %s: instance %s parked %d episodes", cid, name, len(inventory.parked))
        if inventory.restarts:
            log.info(
                "checkpoint %s: instance %s could not park %d episodes (they restart): %s",
                cid,
                name,
                len(inventory.restarts),
                few([ref_name(ref) for ref in inventory.restarts]),
                extra={"checkpoint_id": cid, "instance": name, "restarts": len(inventory.restarts)},
            )
