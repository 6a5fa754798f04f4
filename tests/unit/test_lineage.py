"""One lineage of evidence across restores (rollsafe.evidence.lineage, and the trainer's side:
rollsafe.reference.rl.lineage): what a restore undid leaves the evidence files, evictions the
restored run owns again are undone, trainer checkpoints of undone steps are set aside; and the
trainer-checkpoint anchors a restore accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollsafe.core.phases import PartialGroup, RestorePlan
from rollsafe.evidence.files import (
    MUTATIONS,
    ROLLED_BACK,
    TRAINED,
    EnvMutation,
    TrainedRow,
    append_lines,
    read_lines,
)
from rollsafe.evidence.lineage import Evicted, roll_back, undo_evictions
from rollsafe.reference.rl.lineage import checkpoint_dir, checkpoint_versions, set_aside_checkpoints
from rollsafe.snapshot import accept_weight_versions

SHA = "0" * 64


def row(step: int, idx: int) -> TrainedRow:
    return TrainedRow(
        step=step,
        group_idx=idx,
        rollout_id=f"r-{idx}_g0",
        attempt=0,
        n_tokens=3,
        tokens_sha256=SHA,
        restored_prefix_tokens=0,
    )


def mutation(idx: int) -> EnvMutation:
    return EnvMutation(instance="w0", rollout_id=f"r-{idx}_g0", turn=0, call_id=f"r-{idx}_g0/t0")


def plan(loader_position: int, ready: list[int], partial: list[int]) -> RestorePlan:
    return RestorePlan(
        snapshot="s",
        checkpoint_id="c",
        skipped={},
        loader_position=loader_position,
        weight_version=1,
        ready=ready,
        partial={idx: PartialGroup(restored=[], resumed=[], regenerate=[0]) for idx in partial},
        released_claims=[],
        redispatch=partial,
    )


def test_rows_of_undone_steps_move_aside_with_their_mutations(tmp_path: Path) -> None:
    append_lines(tmp_path / TRAINED, [row(0, 0), row(1, 1), row(2, 2)])
    append_lines(tmp_path / MUTATIONS, [mutation(0), mutation(1), mutation(2)])
    roll_back(tmp_path, first_undone_step=1)
    assert [r.group_idx for r in read_lines(tmp_path / TRAINED, TrainedRow)] == [0]
    assert [r.group_idx for r in read_lines(tmp_path / ROLLED_BACK, TrainedRow)] == [1, 2]
    assert [m.rollout_id for m in read_lines(tmp_path / MUTATIONS, EnvMutation)] == ["r-0_g0"]


def test_evictions_the_restored_run_does_not_know_of_are_undone(tmp_path: Path) -> None:
    path = tmp_path / "evicted.jsonl"
    # 2: evicted before the snapshot; 3: owned again (ready at the snapshot); 5: handed out
    # after the snapshot (the restored run hands it out anew).
    append_lines(path, [Evicted(step=0, group_idx=g) for g in (2, 3, 5)])
    undo_evictions(path, plan(loader_position=5, ready=[3], partial=[4]))
    assert [e.group_idx for e in read_lines(path, Evicted)] == [2]


def test_checkpoints_of_undone_steps_are_set_aside(tmp_path: Path) -> None:
    for version in (0, 2, 4):
        checkpoint_dir(tmp_path, version).mkdir()
    (tmp_path / "very-important").mkdir()  # not a checkpoint: left alone, never parsed
    assert checkpoint_versions(tmp_path) == [0, 2, 4]
    set_aside_checkpoints(tmp_path, newer_than=2, tag="r-1")
    assert checkpoint_versions(tmp_path) == [0, 2]
    assert (tmp_path / "rolled-back" / "r-1" / "v000004").is_dir()


@pytest.mark.parametrize(
    ("versions", "weight_version", "accepted"),
    [(None, 3, True), ((0, 2), 2, True), ((0, 2), 3, False), ((), 0, False)],
)
def test_a_restore_accepts_only_anchored_snapshots(
    versions: tuple[int, ...] | None, weight_version: int, accepted: bool
) -> None:
    accept = accept_weight_versions(versions)
    if accept is None:
        assert versions is None
        return

    class Manifest:  # the one field the rule reads
        pass

    manifest = Manifest()
    manifest.weight_version = weight_version  # type: ignore[attr-defined]
    why = accept(manifest)  # type: ignore[arg-type]
    assert (why is None) == accepted
    if not accepted:
        assert why == f"no trainer checkpoint of its weight version {weight_version}"
