"""Phase 7, commit_envs: every instance exports its parked episodes into the draft
(``envs/<instance>/...``, each file hashed into the manifest) and the draft records what each
committed, which calls were cut and staged (``participants.json``): what a restore needs to
bring the episodes back as attempt n + 1."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollsafe.checkpoint.participants import Participants
from rollsafe.checkpoint.phases.context import (
    LevelOf,
    PhaseContext,
    every_level,
    few,
    ref_name,
    spent_if_resumed,
)
from rollsafe.checkpoint.phases.cut_generation import NO_CUT
from rollsafe.core.phases import PhaseResult
from rollsafe.core.states import RestoreLevel
from rollsafe.env.fleet_rules import FleetCommitted, FleetPrepared
from rollsafe.env.protocol import EpisodeRef

RECORD_FILE = "participants.json"
ENVS_DIR = "envs"
log = logging.getLogger("rollsafe.checkpoint.participants")


class ParticipantsRecord(BaseModel):
    """``participants.json``: what the snapshot's environments and engines committed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[1] = 1
    committed: FleetCommitted
    staged: dict[str, int] = Field(description="cut call id -> prefix tokens staged")
    refused: dict[str, str] = Field(description="call id -> why it was not cut (turn level)")
    stragglers: tuple[EpisodeRef, ...] = Field(description="replies still out after the drain")


def commit_envs(ctx: PhaseContext) -> PhaseResult:
    participants, record = ctx.participants, ctx.record
    if participants is None:
        return ctx.result("no environment instances configured: nothing to commit")
    ctx.drafts.require(record)
    prepared = record.require_prepared("commit_envs")
    with record.draft_lock:  # it writes into the draft
        draft = record.files
        committed = commit(participants, prepared, draft.path, ctx.run.level_of)
        record.committed = committed
        written = ParticipantsRecord(
            committed=committed,
            staged=dict((record.cut or NO_CUT).staged),
            refused={r.call_id: r.reason for r in (record.cut or NO_CUT).refused},
            stragglers=tuple(record.stragglers),
        )
        if RECORD_FILE not in draft.files:  # a retried commit records once
            draft.record(ENVS_DIR)
            draft.write_json(RECORD_FILE, written)
    episodes = sum(len(c.committed) for c in committed.instances.values())
    return ctx.result(f"{episodes} episodes committed", {"committed_episodes": episodes})


def commit(
    participants: Participants,
    prepared: FleetPrepared,
    snapshot_dir: Path,
    level_of: LevelOf = every_level,
) -> FleetCommitted:
    """Each instance exports its parked episodes into ``<snapshot>/envs`` (those whose level
    restores episodes: ``turn`` or ``prefix``)."""
    cid = prepared.checkpoint_id
    scope = {
        name: [p.episode for p in inv.parked if level_of(p.episode) >= RestoreLevel.TURN]
        for name, inv in prepared.instances.items()
    }
    # Absolute: the environment servers write there themselves, from their own cwd.
    dest = snapshot_dir.resolve() / ENVS_DIR
    # The instances' park lease ran out before the commit (a phase took longer than it, on a
    # loaded machine): they resumed and refuse this id; the next snapshot can.
    with spent_if_resumed(cid, "their park lease ran out before the commit"):
        committed = participants.loop.run(participants.fleet.commit_all(cid, scope, dest))
    _log_committed(committed)
    return committed


def _log_committed(committed: FleetCommitted) -> None:
    """An instance that exported less than its scope: those episodes restart."""
    cid = committed.checkpoint_id
    for name, commit_ in sorted(committed.instances.items()):
        if commit_.missing:
            log.warning(
                "checkpoint %s: instance %s did not export %d episodes of its scope (they "
                "restart): %s",
                cid,
                name,
                len(commit_.missing),
                few([ref_name(ref) for ref in commit_.missing]),
                extra={"checkpoint_id": cid, "instance": name, "missing": len(commit_.missing)},
            )
