"""Phase 3, retire_dropped: attempts the run abandoned (restarted, their group dropped) are
retired on the instances that held them, so their effects end there."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from rollsafe.checkpoint.participants import Participants, to_ref
from rollsafe.checkpoint.phases.context import PhaseContext
from rollsafe.core.ledger import Retirement
from rollsafe.core.phases import PhaseResult
from rollsafe.env.protocol import EpisodeRef

log = logging.getLogger("rollsafe.checkpoint.participants")


def retire_dropped(ctx: PhaseContext) -> PhaseResult:
    participants, run = ctx.participants, ctx.run
    if participants is None:
        return ctx.result("no environment instances configured: nothing to retire")
    with run.barrier:
        retirements = run.state.ledger.retirements()
    count = retire(participants, retirements)
    with run.barrier:
        run.state.ledger.mark_retired(r.episode for r in retirements)
    return ctx.result(f"{count} abandoned attempts retired")


def retire(participants: Participants, retirements: Sequence[Retirement]) -> int:
    """Environments refuse abandoned attempts from now on (on the instance that ran them;
    everywhere when the owner is not known)."""
    fleet = participants.fleet
    by_instance: dict[str, list[EpisodeRef]] = {}
    for retirement in retirements:
        # An owner no longer in the fleet (lost for good) can run nothing: every instance
        # refuses the attempt instead, as when the owner is not known.
        known = retirement.owner in fleet.names
        owners = [retirement.owner] if known and retirement.owner else list(fleet.names)
        for name in owners:
            by_instance.setdefault(name, []).append(to_ref(retirement.episode))
    if not by_instance:
        return 0
    counts = participants.loop.run(fleet.retire_all(by_instance))
    for name, count in sorted(counts.items()):
        log.debug("instance %s retired %d abandoned attempts", name, count)
    return sum(counts.values())
