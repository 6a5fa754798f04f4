"""A run an earlier rollsafe wrote restores under this one, and goes on.

tests/fixtures/release-5e93865/ holds what rollsafe 5e93865 (the release before the journal
identity, HEAD, the schema 2 manifest and seal digests) wrote for ``scenario.json`` beside it:
two snapshots and a journal in its formats, ending in a crash. It was made by that release's
own command, as its docs say: ``rollsafe scenario run scenario.json --snapshot-dir DIR``
(run from a checkout of 5e93865). This rollsafe must restore it to the state it restores the
same scenario to when it writes everything itself, then append its own formats after the
earlier ones, and restore that again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from rollsafe.cli.app import app
from rollsafe.dataplane import make_dataplane
from rollsafe.evidence.scenario import SCENARIO_RUN_ID, Scenario, ScenarioReport, ScenarioRunner
from rollsafe.journal.head import read_head
from rollsafe.journal.segments import read_journal

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "release-5e93865"


def scenario(events: list[dict[str, Any]]) -> Scenario:
    raw = json.loads((FIXTURE / "scenario.json").read_text())
    return Scenario.model_validate({**raw, "events": events})


def run(events: list[dict[str, Any]], root: Path) -> ScenarioReport:
    runner = ScenarioRunner(scenario(events), root, lambda: make_dataplane("memory"))
    return runner.run()


def test_an_earlier_releases_snapshots_and_journal_restore_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    earlier = tmp_path / "earlier"
    shutil.copytree(FIXTURE / SCENARIO_RUN_ID, earlier / SCENARIO_RUN_ID)
    # The same events, this rollsafe writing everything: the state both must restore to.
    written = json.loads((FIXTURE / "scenario.json").read_text())["events"]
    expected = run([*written, {"op": "restore"}], tmp_path / "ours")
    assert expected.groups  # a run with something in flight, not an empty one
    restored = run([{"op": "restore"}], earlier)
    assert restored == expected
    journal = earlier / SCENARIO_RUN_ID / "journal"
    # The run went on in this release's format after the earlier one's segments...
    head = read_head(journal)
    assert head is not None and read_journal(journal, SCENARIO_RUN_ID).journal_id == head.journal_id
    # ...and what both wrote restores again, by a later process, with a new seal.
    again = run([{"op": "restore"}, {"op": "commit", "group": 2, "rollouts": [1]}], earlier)
    assert again.groups["2"].state == "ready"
    plan = CliRunner().invoke(app, ["restore", "plan", SCENARIO_RUN_ID, "--root", str(earlier)])
    assert plan.exit_code == 0 and "would be restored from 00000002-rollout" in plan.stdout
