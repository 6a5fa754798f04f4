"""One lineage of evidence across restores: what a restore undid leaves the evidence files (or
moves beside them), so they describe exactly the steps that made the final weights.

Evictions are the trainer's own record (``evicted.jsonl``, not an evidence file): a group
evicted after the snapshot a restore came from is owned by the restored run again, so its
eviction is undone; the others end as ``evicted`` in ``handed_out.jsonl``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from rollsafe.core.phases import RestorePlan
from rollsafe.evidence.files import (
    MUTATIONS,
    ROLLED_BACK,
    TRAINED,
    EnvMutation,
    JsonLine,
    TrainedRow,
    append_lines,
    read_lines,
    replace_lines,
)

EVICTED = "evicted.jsonl"


class Evicted(JsonLine):
    step: int = Field(ge=0, description="the step whose sampler found the group too stale")
    group_idx: int = Field(ge=0)


def roll_back(out: Path, first_undone_step: int) -> None:
    """Rows of steps the restore undid move to rolled_back_rows.jsonl; their rollouts'
    mutations leave env_mutations.jsonl (the rollouts are trained again in this lineage)."""
    if not (out / TRAINED).exists():
        return
    rows = read_lines(out / TRAINED, TrainedRow)
    undone = [row for row in rows if row.step >= first_undone_step]
    if not undone:
        return
    gone = {row.rollout_id for row in undone}
    replace_lines(out / TRAINED, [row for row in rows if row.step < first_undone_step])
    append_lines(out / ROLLED_BACK, undone)
    if (out / MUTATIONS).exists():
        kept = [m for m in read_lines(out / MUTATIONS, EnvMutation) if m.rollout_id not in gone]
        replace_lines(out / MUTATIONS, kept)


def undo_evictions(path: Path, plan: RestorePlan) -> None:
    """Evictions that did not happen in this lineage: of groups the restored run owns again,
    and of groups handed out after the snapshot (the restored run hands them out anew)."""
    if not path.exists():
        return
    owned = {*plan.ready, *plan.partial, *plan.released_claims}
    evictions = read_lines(path, Evicted)
    kept = [e for e in evictions if e.group_idx not in owned and e.group_idx < plan.loader_position]
    if len(kept) != len(evictions):
        replace_lines(path, kept)
