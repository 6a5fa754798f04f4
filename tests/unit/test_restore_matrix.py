"""The six checkpoint situations x three samplers: every case must pass (none xfail), on each
data-plane backend (memory, and TransferQueue on a real Ray: the session's fixture).

Each situation replays a scenario file through the real RunState (snapshot written to disk,
crash drops everything, restore reads it back) and checks the exact owed set, which rollouts
came back and which are regenerated, and what each sampler would train next.
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollsafe.dataplane import DataPlane, make_dataplane
from rollsafe.evidence.scenario import Scenario, ScenarioReport, ScenarioRunner

SCENARIOS = Path(__file__).parent.parent / "scenarios"
SAMPLERS = ["windowed", "in_order", "weight_fifo"]

Group = tuple[str, list[int], list[int]]  # (state, restored, regenerate)
READY: Group = ("ready", [0, 1], [])
EMPTY: Group = ("generating", [], [0, 1])

# situation -> (loader position, weight version, {group: (state, restored, regenerate)},
#               {sampler: next_selection})
EXPECTED: dict[str, tuple[int, int, dict[int, Group], dict[str, list[int]]]] = {
    "s1_all_finished": (
        15,
        1,
        {12: READY, 13: READY, 14: READY},
        {"windowed": [12, 13, 14], "in_order": [12, 13, 14], "weight_fifo": [12, 13, 14]},
    ),
    # Group 10 started under version 0 and is 5 versions stale; it still comes back.
    "s2_one_very_old_group": (
        11,
        5,
        {9: READY, 10: READY},
        {"windowed": [9], "in_order": [9], "weight_fifo": [10]},
    ),
    "s3_one_batch_part_done": (
        15,
        1,
        {12: READY, 13: ("generating", [0], [1]), 14: EMPTY},
        {"windowed": [], "in_order": [], "weight_fifo": []},
    ),
    "s4_two_batches_in_flight": (
        18,
        1,
        {
            12: READY,
            13: READY,
            14: ("generating", [1], [0]),
            15: READY,
            16: ("generating", [0], [1]),
            17: EMPTY,
        },
        {"windowed": [12, 13, 15], "in_order": [], "weight_fifo": []},
    ),
    "s5_one_dropped_on_purpose": (
        15,
        1,
        {12: READY, 13: READY, 14: READY},
        {"windowed": [12, 13, 14], "in_order": [12, 13, 14], "weight_fifo": [12, 13, 14]},
    ),
    "s6_trained_out_of_order": (
        15,
        1,
        {12: ("generating", [0], [1]), 14: READY},
        {"windowed": [14], "in_order": [], "weight_fifo": []},
    ),
}


def runner_for(
    raw: dict[str, Any],
    snapshot_dir: Path,
    planes: Callable[[], DataPlane] = lambda: make_dataplane("memory"),
) -> ScenarioRunner:
    return ScenarioRunner(Scenario.model_validate(raw), snapshot_dir, planes)


def run_scenario(
    name: str,
    sampler: str,
    tmp_path: Path,
    planes: Callable[[], DataPlane] | None = None,
    **overrides: Any,
) -> tuple[ScenarioRunner, ScenarioReport]:
    raw = json.loads((SCENARIOS / f"{name}.json").read_text())
    raw.update(sampler=sampler, **overrides)
    runner = runner_for(raw, tmp_path) if planes is None else runner_for(raw, tmp_path, planes)
    return runner, runner.run()


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("situation", sorted(EXPECTED))
def test_restore_matrix(
    situation: str, sampler: str, tmp_path: Path, dataplane_factory: Callable[[], DataPlane]
) -> None:
    loader, version, groups, selections = EXPECTED[situation]
    runner, report = run_scenario(situation, sampler, tmp_path, dataplane_factory)
    assert report.loader_position == loader
    assert report.weight_version == version
    got = {
        int(idx): (g.state, g.restored_rollouts, g.regenerate) for idx, g in report.groups.items()
    }
    assert got == groups
    assert report.next_selection == selections[sampler]
    # The restored rows are the committed ones, byte for byte, and nothing else is stored.
    run = runner.state
    assert run is not None
    stored = set(run.dataplane.list("rollouts"))
    sealed = {run.row_key(idx, i) for idx, (_, restored, _) in groups.items() for i in restored}
    assert stored == sealed


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_restore_is_the_same_as_before_the_crash(sampler: str, tmp_path: Path) -> None:
    """Restoring changes nothing that the checkpoint captured (claims aside)."""
    raw = json.loads((SCENARIOS / "s4_two_batches_in_flight.json").read_text())
    raw.update(sampler=sampler, events=raw["events"][:-2])  # stop right after the checkpoint
    runner = runner_for(raw, tmp_path)
    before = runner.run()
    _, after = run_scenario("s4_two_batches_in_flight", sampler, tmp_path / "again")
    assert after == before


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_claimed_groups_of_an_uncommitted_step_come_back(sampler: str, tmp_path: Path) -> None:
    events = [
        {"op": "handout", "groups": [0, 1, 2, 3]},
        *({"op": "commit", "group": g, "rollouts": [0, 1]} for g in range(4)),
        {"op": "claim", "groups": [0, 1]},
        {"op": "checkpoint"},
        {"op": "crash"},
        {"op": "restore"},
    ]
    raw = {
        "name": "claims",
        "sampler": sampler,
        "group_size": 2,
        "groups_per_step": 2,
        "events": events,
    }
    runner = runner_for(raw, tmp_path)
    report = runner.run()
    assert {int(k): g.state for k, g in report.groups.items()} == {g: "ready" for g in range(4)}
    assert report.next_selection == [0, 1]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_prompt_group_level_regenerates_the_whole_partial_group(
    sampler: str, tmp_path: Path
) -> None:
    runner, report = run_scenario(
        "s3_one_batch_part_done", sampler, tmp_path, restore_level="prompt_group"
    )
    assert report.groups["13"].model_dump() == {
        "state": "generating",
        "restored_rollouts": [],
        "regenerate": [0, 1],
    }
    run = runner.state
    assert run is not None
    # The sealed half was discarded: its row is gone and the rollout owes a new attempt.
    assert "scenario-13_g0" not in run.dataplane.list("rollouts")
    assert run.ledger.attempt(13, 0) == 1
