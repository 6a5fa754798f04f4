"""Scenario files with ``"journal": true``: a crash after seals and without a new checkpoint
restores those seals, hand-outs and evictions; ``restore`` with ``weight_version`` rolls back
the steps trained after those weights. Without the flag a scenario means what it always did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollsafe.core.ids import checkpoint_id_for
from rollsafe.dataplane import make_dataplane
from rollsafe.errors import ScenarioError
from rollsafe.evidence.scenario import SCENARIO_RUN_ID, Scenario, ScenarioReport, ScenarioRunner
from rollsafe.faults import arm, disarm_all
from rollsafe.snapshot import SnapshotStore


def run(events: list[dict[str, Any]], tmp_path: Path, **extra: object) -> ScenarioReport:
    raw = {
        "name": "journal",
        "sampler": "windowed",
        "group_size": 2,
        "groups_per_step": 1,
        "staleness_window": 4,
        "events": events,
        **extra,
    }
    runner = ScenarioRunner(
        Scenario.model_validate(raw), tmp_path, lambda: make_dataplane("memory")
    )
    return runner.run()


AFTER_A_CHECKPOINT: list[dict[str, Any]] = [
    {"op": "handout", "groups": [0]},
    {"op": "commit", "group": 0, "rollouts": [0, 1]},
    {"op": "checkpoint"},
    {"op": "handout", "groups": [1, 2, 3]},
    {"op": "commit", "group": 1, "rollouts": [0, 1]},
    {"op": "commit", "group": 2, "rollouts": [0]},
    {"op": "evict", "group": 3},
    {"op": "train", "groups": [0]},
    {"op": "crash"},
]


def test_with_the_journal_a_crash_loses_nothing_sealed_after_the_checkpoint(tmp_path: Path) -> None:
    report = run([*AFTER_A_CHECKPOINT, {"op": "restore"}], tmp_path, journal=True)
    assert report.loader_position == 4 and report.weight_version == 1
    assert set(report.groups) == {"1", "2"}  # 0 trained, 3 evicted
    assert report.groups["1"].state == "ready"
    assert report.groups["2"].restored_rollouts == [0]
    assert report.groups["2"].regenerate == [1]


def test_without_it_the_scenario_means_what_it_meant(tmp_path: Path) -> None:
    report = run([*AFTER_A_CHECKPOINT, {"op": "restore"}], tmp_path)
    assert report.loader_position == 1 and report.weight_version == 0
    assert set(report.groups) == {"0"} and report.groups["0"].state == "ready"


def test_restore_at_older_weights_rolls_back_the_steps_after_them(tmp_path: Path) -> None:
    events = [*AFTER_A_CHECKPOINT, {"op": "restore", "weight_version": 0}]
    report = run(events, tmp_path, journal=True)
    assert report.weight_version == 0
    assert report.groups["0"].state == "ready"  # trained after weights 0: owed again
    assert report.groups["0"].restored_rollouts == [0, 1]


def test_weights_the_run_never_reached_are_an_error_naming_them(tmp_path: Path) -> None:
    events = [*AFTER_A_CHECKPOINT, {"op": "restore", "weight_version": 3}]
    with pytest.raises(ScenarioError, match="not the 3 the trainer restored"):
        run(events, tmp_path, journal=True)


def test_a_second_process_restores_a_journal_run_and_leaves_it_restorable(tmp_path: Path) -> None:
    # The first process crashes; each later one starts with "restore", as `rollsafe scenario
    # run` does when it continues a run: nothing is written before its restore succeeded.
    run(AFTER_A_CHECKPOINT, tmp_path, journal=True)
    journal = tmp_path / "scenario" / "journal"
    for _ in range(2):
        report = run([{"op": "restore"}, {"op": "commit", "group": 2, "rollouts": [1]}],
                     tmp_path, journal=True)  # fmt: skip
        assert report.loader_position == 4 and report.weight_version == 1
        assert report.groups["2"].state == "ready"
        assert not list(journal.glob("set-aside/*"))
    again = run([{"op": "restore"}], tmp_path, journal=True)
    assert again.groups["2"].restored_rollouts == [0, 1]


def test_a_scenario_checkpoint_runs_the_controllers_phases(tmp_path: Path) -> None:
    """Scenario checkpoints take the worker's path: the ten phases in order (so the matrices
    exercise capture in the park window, the write after resume, deletions held)."""
    events: list[dict[str, Any]] = [
        {"op": "handout", "groups": [0]},
        {"op": "checkpoint"},
        {"op": "checkpoint"},
    ]
    run(events, tmp_path)
    published = SnapshotStore(tmp_path, SCENARIO_RUN_ID).published_manifests()
    assert sorted(m.checkpoint_id for m in published) == [
        checkpoint_id_for(SCENARIO_RUN_ID, seq, "rollout") for seq in (1, 2)
    ]
    arm("phase.capture.before", "raise")
    try:
        with pytest.raises(ScenarioError, match=r"event 2 \(checkpoint\).*phase\.capture\.before"):
            run(events[:2], tmp_path / "faulted")
    finally:
        disarm_all()
