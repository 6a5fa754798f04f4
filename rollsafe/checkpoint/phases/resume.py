"""Phase 9, resume: the environments and engines go on and admission reopens, even when an
instance could not be reached (its park lease ends its park). Abort is resume that also throws
the draft away: both reopen through :func:`reopen`."""

from __future__ import annotations

import asyncio
import logging

from rollsafe.checkpoint.participants import Participants
from rollsafe.checkpoint.phase_ledger import ABORT
from rollsafe.checkpoint.phases.context import PhaseContext, engine_failure
from rollsafe.core.gate import GateChange
from rollsafe.core.phases import Phase, PhaseResult
from rollsafe.engine.protocol import Engine
from rollsafe.engine.staging import StagedCut
from rollsafe.errors import TransientError
from rollsafe.observability import metrics

log = logging.getLogger("rollsafe.checkpoint.participants")


def resume(ctx: PhaseContext) -> PhaseResult:
    resumed, change = reopen(ctx, count=True)
    return ctx.result(f"{resumed}admission {change.detail}")


def abort(ctx: PhaseContext) -> PhaseResult:
    """Discard the draft, if any, and reopen the gate; stored results are kept. ``ctx``
    is for phase resume (the result abort stores)."""
    resumed, change = reopen(ctx, count=False)
    record = ctx.drafts.entry(ctx.checkpoint_id)
    if record is not None:
        ctx.drafts.discard(record, "aborted")  # for a phase that found it before abort
    discarded = "draft discarded" if record else "no draft to discard"
    ctx.ledger.count(ABORT, record is not None or change.changed)
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
    participants, record = ctx.participants, ctx.record
    if participants is None:
        return ""
    resumed = resume_participants(participants, ctx.checkpoint_id, record.cut)
    # Done with (kept until here: a retried resume releases the cut calls too).
    record.prepared, record.cut = None, None
    if ctx.drafts.entry(ctx.checkpoint_id) is None or record.capture is None:
        ctx.drafts.drop_staged()  # else they go once the capture is written
    return resumed + "; "


def resume_participants(
    participants: Participants, checkpoint_id: str, cut: StagedCut | None
) -> str:
    """Environments resume, frozen calls go on; every exit path. The staged prefixes stay in
    the live data plane until the capture is written (kept, every later capture would export
    them again)."""
    frozen = _maybe_frozen(cut) if cut is not None else []

    async def resume_all() -> list[str]:
        await participants.fleet.resume_all(checkpoint_id)
        if not frozen:
            return []
        failed = await asyncio.gather(
            *(
                _release(participants, name, engine, frozen)
                for name, engine in participants.engines.items()
            )
        )
        return [why for why in failed if why]

    not_released = participants.loop.run(resume_all())
    instances = len(participants.fleet.names)
    log.debug(
        "checkpoint %s: %d instances resumed, %d cut calls released",
        checkpoint_id,
        instances,
        len(frozen),
    )
    summary = f"{instances} instances resumed, {len(frozen)} cut calls released"
    return summary + "".join(f" ({why})" for why in not_released)


def _maybe_frozen(cut: StagedCut) -> list[str]:
    """The calls a cut may have frozen: those staged, and those of an engine that did not
    answer (a slow one may have frozen them after all): every engine releases them all."""
    unanswered = [r.call_id for r in cut.refused if r.reason == "engine_unavailable"]
    return [*cut.staged, *unanswered]


async def _release(
    participants: Participants, name: str, engine: Engine, calls: list[str]
) -> str | None:
    """Release ``calls`` on one engine; why not, if it did not answer in time. Not raised: an
    engine that cannot be reached either died, and its frozen calls with it (their episodes'
    runs fail and are sent again), or hangs and generates nothing either way; failing the
    phase would only keep the snapshot from publishing until it is back."""
    deadline_s = participants.options.engine_deadline_s
    try:
        await asyncio.wait_for(engine.release(calls), deadline_s)
        return None
    except (TimeoutError, TransientError) as exc:
        why = f"engine {name} did not release its cut calls: {engine_failure(exc, deadline_s)}"
        log.warning("%s", why, extra={"engine": name})
        return why
