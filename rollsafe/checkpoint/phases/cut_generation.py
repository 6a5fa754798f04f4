"""Phase 6, cut_generation: the engines cut the calls of ``prefix``-level groups' parked
episodes and stage their prefixes in the data plane (rollsafe.engine.staging)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from rollsafe.checkpoint.participants import Participants
from rollsafe.checkpoint.phases.context import (
    LevelOf,
    PhaseContext,
    engine_failure,
    every_level,
    few,
)
from rollsafe.core.phases import PhaseResult
from rollsafe.core.states import RestoreLevel
from rollsafe.dataplane import DataPlane
from rollsafe.engine.protocol import CutRefusal, Engine
from rollsafe.engine.staging import StagedCut, cut_and_stage
from rollsafe.env.fleet_rules import FleetPrepared
from rollsafe.errors import TransientError
from rollsafe.observability import metrics

log = logging.getLogger("rollsafe.checkpoint.participants")
# What an engine that does not hold a call answers: another engine may know better.
NOT_HERE = frozenset({"not_admitted", "unknown_call"})
NO_CUT = StagedCut(staged={}, refused=(), handoffs=0)


def cut_generation(ctx: PhaseContext) -> PhaseResult:
    participants = ctx.participants
    if participants is None:
        return ctx.result("no generation engines configured: nothing to cut")
    prepared = ctx.record.require_prepared("cut_generation")
    cut = cut_calls(participants, prepared, ctx.run.state.dataplane, ctx.run.level_of)
    ctx.record.cut = cut
    metrics.record_cut(ctx.spec.run_id, cut)
    outcomes = metrics.cut_outcomes(cut)
    summary = (
        f"{outcomes['cut']} calls cut and staged, {outcomes['skipped']} skipped "
        f"(finished, not started, or a coarser restore level), {outcomes['failed']} "
        "could not be cut (turn level)"
    )
    return ctx.result(summary, outcomes)


def cut_calls(
    participants: Participants,
    prepared: FleetPrepared,
    dataplane: DataPlane,
    level_of: LevelOf = every_level,
) -> StagedCut:
    """Freeze the parked episodes' calls still generating and stage their prefixes; a call no
    engine could cut is committed at turn level. Only episodes whose level is ``prefix`` are
    cut (at any other level the prefix would never be used)."""
    generating = [
        (p.model_call_id, level_of(p.episode))
        for inv in prepared.instances.values()
        for p in inv.parked
        if p.activity == "generating" and p.model_call_id is not None
    ]
    calls = [call for call, level in generating if level == RestoreLevel.PREFIX]
    cut = (
        participants.loop.run(_cut_everywhere(participants, calls, dataplane)) if calls else NO_CUT
    )
    skipped = tuple(call for call, level in generating if level != RestoreLevel.PREFIX)
    cut = cut.model_copy(update={"skipped": skipped})
    _log_cut(prepared.checkpoint_id, cut)
    return cut


async def _cut_everywhere(
    participants: Participants, calls: list[str], dataplane: DataPlane
) -> StagedCut:
    """Cut on every engine at once (one pass: every engine answers for every call at once, so
    no call is tried again) and merge (:func:`merge_cuts`)."""
    deadline_s = participants.options.engine_deadline_s
    results = await asyncio.gather(
        *(
            _cut_on(name, engine, calls, dataplane, deadline_s)
            for name, engine in participants.engines.items()
        )
    )
    return merge_cuts(calls, results)


async def _cut_on(
    name: str, engine: Engine, calls: list[str], dataplane: DataPlane, deadline_s: float
) -> StagedCut:
    """One engine's cut, or, when it does not answer (dead, unreachable, past the deadline),
    every call refused as ``engine_unavailable``: committed at turn level, those calls are
    made again from their turn after a restore, never resumed from a prefix nobody staged.
    The snapshot goes on with the other engines' cuts."""
    try:
        return await asyncio.wait_for(cut_and_stage(engine, calls, dataplane), deadline_s)
    except (TimeoutError, TransientError) as exc:
        detail = f"engine {name}: {engine_failure(exc, deadline_s)}"
        log.warning(
            "cut on engine %s failed; its calls are committed at turn level: %s", name, detail
        )
        refused = tuple(
            CutRefusal(call_id=call, reason="engine_unavailable", detail=detail) for call in calls
        )
        return StagedCut(staged={}, refused=refused, handoffs=0)


def merge_cuts(calls: Sequence[str], results: Sequence[StagedCut]) -> StagedCut:
    """Every engine's cut of ``calls`` as one: a call staged by one engine is staged; else the
    reason of the engine that held it (the others say ``not_admitted``), else
    ``engine_unavailable`` if an engine did not answer (it may have held it), or
    ``not_admitted`` from all of them."""
    staged = {call: tokens for result in results for call, tokens in result.staged.items()}
    reasons: dict[str, CutRefusal] = {}
    for refusal in (refusal for result in results for refusal in result.refused):
        known = reasons.get(refusal.call_id)
        if refusal.call_id not in staged and (
            known is None or _weight(refusal.reason) > _weight(known.reason)
        ):
            reasons[refusal.call_id] = refusal
    refused = tuple(
        reasons.get(call) or CutRefusal(call_id=call, reason="unknown_call")  # no engine
        for call in calls
        if call not in staged
    )
    handoffs = sum(result.handoffs for result in results)
    return StagedCut(staged=staged, refused=refused, handoffs=handoffs)


def _weight(reason: str) -> int:
    """Which engine's refusal of a call says most: one that held it, then one that did not
    answer (it may have held it), then one that never saw it."""
    return 0 if reason in NOT_HERE else 1 if reason == "engine_unavailable" else 2


def _log_cut(checkpoint_id: str, cut: StagedCut) -> None:
    """Calls an engine could not cut lose their generated tokens (they restart at the turn):
    a WARNING; calls not cut because there was nothing to lose: DEBUG."""
    lost = [r for r in cut.refused if r.reason not in metrics.SKIPPED_REFUSALS]
    harmless = len(cut.refused) - len(lost)
    log.debug(
        "checkpoint %s: %d calls cut, %d skipped (coarser level), %d not started or done",
        checkpoint_id,
        len(cut.staged),
        len(cut.skipped),
        harmless,
    )
    if lost:
        log.warning(
            "checkpoint %s: %d generation calls could not be cut and restart from their turn: %s",
            checkpoint_id,
            len(lost),
            few([f"{r.call_id} ({r.reason}{': ' + r.detail if r.detail else ''})" for r in lost]),
            extra={"checkpoint_id": checkpoint_id, "refused_calls": len(lost)},
        )
