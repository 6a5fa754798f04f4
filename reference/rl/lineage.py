"""A trainer's checkpoints in one lineage: their directories, the weight versions they hold, and
those of steps a restore undid set aside (the evidence files' side of a restore is
:mod:`rollsafe.evidence.lineage`).
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_PREFIX = "v"


def checkpoint_dir(directory: Path, version: int) -> Path:
    return directory / f"{CHECKPOINT_PREFIX}{version:06d}"


def checkpoint_versions(directory: Path) -> list[int]:
    """Weight versions the trainer holds checkpoints of (those a restore may start from)."""
    named = (p.name[len(CHECKPOINT_PREFIX) :] for p in directory.glob(f"{CHECKPOINT_PREFIX}*"))
    return sorted(int(n) for n in named if n.isdigit())


def set_aside_checkpoints(directory: Path, newer_than: int, tag: str) -> None:
    """Trainer checkpoints of the undone steps move to ``rolled-back/<restore>/``: kept for a
    post-mortem, out of the way of the steps this lineage commits under the same versions."""
    for version in checkpoint_versions(directory):
        if version > newer_than:
            aside = directory / "rolled-back" / tag
            aside.mkdir(parents=True, exist_ok=True)
            checkpoint = checkpoint_dir(directory, version)
            checkpoint.rename(aside / checkpoint.name)
