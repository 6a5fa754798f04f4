"""A run's evidence, written as the run goes (the formats of :mod:`rollsafe.evidence.files`), by
whatever drives it: the rollout source (:mod:`rollsafe.source`) and the reference run. ``rollsafe
verify DIR`` then checks the run from these files alone.

A trained row is described by the row's ``tokens`` array (its count and sha256, as little-endian
int32) and its optional ``restored_prefix_tokens`` (tokens a resumed call took from a cut's
prefix instead of generating them): a run whose rows have no ``tokens`` leaves no evidence.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rollsafe.core.ids import EpisodeId, GroupId
from rollsafe.core.phases import RestorePlan
from rollsafe.errors import InvalidInput
from rollsafe.evidence.files import (
    FAULTS,
    GENERATIONS,
    HANDED_OUT,
    MUTATIONS,
    REPORT,
    TRAINED,
    GenerationEvent,
    HandedOut,
    RunReport,
    TrainedRow,
    append_lines,
    read_lines,
    replace_lines,
    write_report,
)
from rollsafe.evidence.lineage import EVICTED, Evicted, roll_back, undo_evictions

TOKENS_FIELD = "tokens"
RESTORED_FIELD = "restored_prefix_tokens"


def tokens_sha256(row: Mapping[str, np.ndarray]) -> str:
    return hashlib.sha256(np.ascontiguousarray(row[TOKENS_FIELD], "<i4").tobytes()).hexdigest()


def trained_row(
    step: int, idx: int, rollout_id: str, attempt: int, row: Mapping[str, Any]
) -> TrainedRow:
    """The evidence line of one rollout a step trained."""
    if TOKENS_FIELD not in row:
        raise InvalidInput(
            f"{rollout_id}: its row has no {TOKENS_FIELD!r} field, which the evidence describes "
            f"a trained rollout by (fields: {sorted(row)})"
        )
    return TrainedRow(
        step=step,
        group_idx=idx,
        rollout_id=rollout_id,
        attempt=attempt,
        n_tokens=int(np.asarray(row[TOKENS_FIELD]).size),
        tokens_sha256=tokens_sha256(row),
        restored_prefix_tokens=int(row.get(RESTORED_FIELD, 0)),
    )


def record_generation(path: Path, event: Literal["started", "sealed"], episode: EpisodeId) -> None:
    """An attempt's generation started, or its seal was acknowledged (``generations.jsonl``)."""
    line = GenerationEvent(
        event=event, rollout_id=episode.rollout.key, attempt=episode.attempt, at_unix=time.time()
    )
    append_lines(path, [line])


def write_handed_out(
    out: Path, run_id: str, loader_position: int, evicted: Path | None = None
) -> None:
    """``handed_out.jsonl``: every group below the loader position, trained (in
    ``trained_rows.jsonl``), evicted (in the run's ``evicted`` record) or still owed."""
    trained = {row.group_idx for row in read_lines(out / TRAINED, TrainedRow, optional=True)}
    gone = {e.group_idx for e in read_lines(evicted, Evicted, optional=True)} if evicted else set()
    lines = [
        HandedOut(
            group_idx=idx,
            group_id=GroupId(run_id, idx).key,
            status="trained" if idx in trained else "evicted" if idx in gone else "owed",
        )
        for idx in range(loader_position)
    ]
    replace_lines(out / HANDED_OUT, lines)


class EvidenceRecorder:
    """The evidence of one run in ``out``, across any number of its processes: each restore
    moves what it undid aside (:meth:`restored`), :meth:`finish` writes the run's totals."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        for name in (TRAINED, MUTATIONS, FAULTS):  # a run without any says so, empty
            (self.out / name).touch()

    def generation(self, event: Literal["started", "sealed"], episode: EpisodeId) -> None:
        record_generation(self.out / GENERATIONS, event, episode)

    def trained(self, rows: Sequence[TrainedRow]) -> None:
        append_lines(self.out / TRAINED, rows)

    def evicted(self, step: int, groups: Sequence[int]) -> None:
        """Recorded before the eviction is asked for: a crash in between cannot lose it."""
        append_lines(self.out / EVICTED, [Evicted(step=step, group_idx=idx) for idx in groups])

    def restored(self, plan: RestorePlan) -> None:
        roll_back(self.out, first_undone_step=plan.weight_version)
        undo_evictions(self.out / EVICTED, plan)

    def finish(self, report: RunReport, loader_position: int) -> None:
        write_handed_out(self.out, report.run_id, loader_position, self.out / EVICTED)
        write_report(self.out / REPORT, report)
