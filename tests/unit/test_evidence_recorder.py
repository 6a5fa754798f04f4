"""A run's evidence written as it goes (rollsafe.evidence.recorder), across a restore: what the
restore undid moves aside, the evictions of groups it owns again are undone, and the files
then pass every check of ``rollsafe verify``; a row without tokens is named, not recorded; a
generation sealed twice is what the check finds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rollsafe.core.ids import EpisodeId, GroupId
from rollsafe.core.phases import RestorePlan
from rollsafe.errors import InvalidInput
from rollsafe.evidence.files import Evidence, RunReport
from rollsafe.evidence.recorder import EvidenceRecorder, trained_row
from rollsafe.evidence.verify import verify

RUN = "rec"


def episode(idx: int, i: int, attempt: int = 0) -> EpisodeId:
    return GroupId(RUN, idx).rollout(i).episode(attempt)


def generate(recorder: EvidenceRecorder, idx: int) -> None:
    for i in range(2):
        recorder.generation("started", episode(idx, i))
        recorder.generation("sealed", episode(idx, i))


def train(recorder: EvidenceRecorder, step: int, idx: int) -> None:
    row = {"tokens": np.array([idx, 1, 2], np.int32)}
    recorder.trained(
        [trained_row(step, idx, episode(idx, i).rollout.key, 0, row) for i in range(2)]
    )


def report(steps: int) -> RunReport:
    return RunReport(
        run_id=RUN, seed=0, steps=steps, group_size=2, groups_per_step=1, sampler="in_order",
        restore_level="prefix", deterministic=False, journal=True,
    )  # fmt: skip


def plan(weight_version: int, ready: list[int], loader_position: int) -> RestorePlan:
    return RestorePlan(
        snapshot="s", checkpoint_id="c", skipped={}, loader_position=loader_position,
        weight_version=weight_version, ready=ready, partial={}, released_claims=[], redispatch=[],
    )  # fmt: skip


def checks(out: Path) -> dict[str, bool]:
    return {check.name: check.ok for check in verify(Evidence.read(out))}


def test_a_run_restored_once_leaves_evidence_that_verifies(tmp_path: Path) -> None:
    recorder = EvidenceRecorder(tmp_path)
    for step in range(3):  # steps 0..2 train groups 0..2; group 3 is evicted
        generate(recorder, step)
        train(recorder, step, step)
    recorder.evicted(3, [3])
    # A restore to weight version 2: step 2 is undone, group 2 is ready again, the eviction of
    # group 3 (handed out after the snapshot) did not happen in this lineage.
    later = EvidenceRecorder(tmp_path)
    later.restored(plan(weight_version=2, ready=[2], loader_position=3))
    train(later, 2, 2)  # trained again from its sealed rows: not generated again
    generate(later, 3)
    train(later, 3, 3)
    later.finish(report(4), loader_position=4)
    evidence = Evidence.read(tmp_path)
    assert sorted({row.group_idx for row in evidence.rolled_back}) == [2]
    assert sorted(row.group_idx for row in evidence.trained) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [line.status for line in evidence.handed_out] == ["trained"] * 4
    assert set(checks(tmp_path).values()) == {True}, checks(tmp_path)


def test_a_rollout_sealed_twice_fails_its_check(tmp_path: Path) -> None:
    recorder = EvidenceRecorder(tmp_path)
    generate(recorder, 0)
    generate(recorder, 0)  # generated again after it sealed
    train(recorder, 0, 0)
    recorder.finish(report(1), loader_position=1)
    assert checks(tmp_path)["no sealed rollout generated twice"] is False


def test_a_row_without_tokens_is_named() -> None:
    with pytest.raises(
        InvalidInput, match=r"rec-0_g0: its row has no 'tokens' field, .*fields: \['reward'\]"
    ):
        trained_row(0, 0, "rec-0_g0", 0, {"reward": np.array(1.0)})
