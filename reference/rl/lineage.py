"""One lineage of evidence across restores: what a restore undid leaves the evidence files (or
moves beside them), so they describe exactly the steps that made the final weights.

Evictions are the trainer's own record (``<work>/evicted.jsonl``, not an evidence file): a group
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
CHECKPOINT_PREFIX = "v"


class Evicted(JsonLine):
    step: int = Field(ge=0, description="the step whose sampler found the group too stale")
    group_idx: int = Field(ge=0)


def checkpoint_dir(directory: Path, version: int) -> Path:
    return directory / f"{CHECKPOINT_PREFIX}{version:06d}"


def checkpoint_versions(directory: Path) -> list[int]:
    """Weight versions the trainer holds checkpoints of (those a restore may start from)."""
    named = (p.name[len(CHECKPOINT_PREFIX) :] for p in directory.glob(f"{CHECKPOINT_PREFIX}*"))
    return sorted(int(n) for n in named if n.isdigit())


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


def set_aside_checkpoints(directory: Path, newer_than: int, tag: str) -> None:
    """Trainer checkpoints of the undone steps move to ``rolled-back/<restore>/``: kept for a
    post-mortem, out of the way of the steps this lineage commits under the same versions."""
    for version in checkpoint_versions(directory):
        if version > newer_than:
            aside = directory / "rolled-back" / tag
            aside.mkdir(parents=True, exist_ok=True)
            checkpoint = checkpoint_dir(directory, version)
            checkpoint.rename(aside / checkpoint.name)


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
