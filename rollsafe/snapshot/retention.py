"""Which published snapshots retention keeps: the rule, with no I/O (docs/snapshot-format.md,
"Retention").

Kept, whatever their age:

- the newest ``keep_latest_k`` snapshots whose manifest reads back (so always the newest one);
- for each **anchor** (a weight version the trainer holds a checkpoint of), the newest
  snapshot at that weight version whose manifest reads back: a restore anchored to those
  weights (``accept_weight_versions``) can use only such a snapshot, and periodic snapshots
  at later weight versions must never push it out;
- a snapshot whose manifest does not read back (damaged, or still uploading) if it is newer
  than the oldest of the newest k: it is left for an operator and costs no good snapshot.

Everything else is deleted. With fewer than k readable snapshots nothing is. Manifests are
read lazily, newest first, and only while an answer still depends on them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

# name -> the weight version its manifest records, or None when the manifest does not read back
ReadWeightVersion = Callable[[str], int | None]


@dataclass(frozen=True)
class RetentionPlan:
    keep: frozenset[str]
    delete: tuple[str, ...]  # newest first
    # seq of the oldest of the newest k readable snapshots (None: fewer than k, none deleted)
    cut: int | None


def plan_retention(
    published: Sequence[tuple[int, str]],
    read_weight_version: ReadWeightVersion,
    keep_latest_k: int,
    anchors: Collection[int] = (),
) -> RetentionPlan:
    """``published``: (seq, name) of every published snapshot, in any order."""
    newest_first = sorted(published, reverse=True)
    unfound = set(anchors)
    latest: list[int] = []  # seqs of the newest k readable
    keep: set[str] = set()
    unreadable: list[tuple[int, str]] = []
    for seq, name in newest_first:
        if len(latest) >= keep_latest_k and not unfound:
            break  # nothing older can be kept: no need to read its manifest
        version = read_weight_version(name)
        if version is None:
            unreadable.append((seq, name))
            continue
        if len(latest) < keep_latest_k:
            latest.append(seq)
            keep.add(name)
        if version in unfound:
            unfound.discard(version)
            keep.add(name)
    if len(latest) < keep_latest_k:
        return RetentionPlan(frozenset(name for _, name in newest_first), (), None)
    cut = latest[-1]
    keep.update(name for seq, name in unreadable if seq > cut)
    delete = tuple(name for _, name in newest_first if name not in keep)
    return RetentionPlan(frozenset(keep), delete, cut)
