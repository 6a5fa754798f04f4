"""Phase 7, commit_envs: every instance exports its parked episodes into the draft
(``envs/<instance>/...``) and the draft records what each committed (``participants.json``)."""

from __future__ import annotations

from rollsafe.checkpoint.participants import ENVS_DIR, RECORD_FILE
from rollsafe.checkpoint.phases.context import PhaseContext
from rollsafe.core.phases import PhaseResult


def commit_envs(ctx: PhaseContext) -> PhaseResult:
    participants = ctx.participants
    if participants is None:
        return ctx.result("no environment instances configured: nothing to commit")
    entry = ctx.drafts.require(ctx.spec)
    with entry.lock:  # it writes into the draft
        entry.check_usable()
        committed = participants.commit(ctx.checkpoint_id, entry.draft.path, ctx.run.level_of)
        if RECORD_FILE not in entry.draft.files:  # a retried commit records once
            entry.draft.record(ENVS_DIR)
            entry.draft.write_json(RECORD_FILE, committed)
    episodes = sum(len(c.committed) for c in committed.committed.instances.values())
    return ctx.result(f"{episodes} episodes committed", {"committed_episodes": episodes})
