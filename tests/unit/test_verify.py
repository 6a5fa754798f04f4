"""``rollsafe verify``: the evidence files of a run, checked alone; every violation named."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from rollsafe.cli.app import app
from rollsafe.errors import EvidenceError
from rollsafe.evidence.files import (
    FAULTS,
    GENERATIONS,
    HANDED_OUT,
    MUTATIONS,
    REPORT,
    TRAINED,
    Evidence,
)
from rollsafe.evidence.verify import account_generations, verify

GROUP_SIZE = 2


def tokens_sha(rollout_id: str, salt: str = "") -> str:
    return hashlib.sha256(f"{rollout_id}{salt}".encode()).hexdigest()


def good_run() -> dict[str, list[dict[str, Any]]]:
    """Groups 0-3 trained two per step, 4 evicted, 5 owed; three turns a rollout."""
    trained, mutations = [], []
    for idx in range(4):
        for i in range(GROUP_SIZE):
            rid = f"demo-{idx}_g{i}"
            trained.append(
                {
                    "step": idx // 2,
                    "group_idx": idx,
                    "rollout_id": rid,
                    "attempt": i % 2,
                    "n_tokens": 12,
                    "tokens_sha256": tokens_sha(rid),
                    "restored_prefix_tokens": 0,
                }
            )
            mutations += [
                {"instance": f"env-{i}", "rollout_id": rid, "turn": t, "call_id": f"{rid}/{t}"}
                for t in range(3)
            ]
    status = ["trained"] * 4 + ["evicted", "owed"]
    handed = [{"group_idx": g, "group_id": f"demo-{g}", "status": s} for g, s in enumerate(status)]
    return {TRAINED: trained, HANDED_OUT: handed, MUTATIONS: mutations, FAULTS: []}


def write(directory: Path, run: dict[str, list[dict[str, Any]]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, lines in run.items():
        (directory / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = {
        "run_id": "demo",
        "seed": 1,
        "steps": 2,
        "group_size": GROUP_SIZE,
        "groups_per_step": 2,
        "sampler": "in_order",
        "restore_level": "prefix",
        "deterministic": True,
    }
    (directory / REPORT).write_text(json.dumps(report))
    return directory


def failed(run: dict[str, list[dict[str, Any]]], tmp_path: Path) -> dict[str, str]:
    checks = verify(Evidence.read(write(tmp_path / "run", run)))
    return {check.name: check.detail for check in checks if not check.ok}


def test_a_clean_run_passes_every_check(tmp_path: Path) -> None:
    checks = verify(Evidence.read(write(tmp_path / "run", good_run())))
    assert [c.ok for c in checks] == [True] * 4
    result = CliRunner().invoke(app, ["verify", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert "VIOLATED" not in result.output and "no rollout in two steps" in result.output


def test_a_skipped_prompt_is_named(tmp_path: Path) -> None:
    run = good_run()
    run[HANDED_OUT] = [line for line in run[HANDED_OUT] if line["group_idx"] != 4]
    assert (
        "group 4 never handed out" in failed(run, tmp_path)["handed-out groups contiguous from 0"]
    )


def test_a_group_handed_out_twice_is_named(tmp_path: Path) -> None:
    run = good_run()
    run[HANDED_OUT].append(dict(run[HANDED_OUT][5]))
    assert "group 5 listed 2 times" in failed(run, tmp_path)["handed-out groups contiguous from 0"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        # the same group trained again by a later step
        (
            lambda r: r[TRAINED].extend(dict(x, step=5) for x in r[TRAINED][:2]),
            "group 0 trained by steps [0, 5]",
        ),
        # a group trained with one of its two rollouts
        (lambda r: r[TRAINED].pop(0), "group 0 trained with 1 rows of 1 rollouts"),
        # an evicted group's rows in a step
        (
            lambda r: r[TRAINED].append(dict(r[TRAINED][0], group_idx=4, rollout_id="demo-4_g0")),
            "group 4 was trained but is evicted",
        ),
        # a group marked trained that no step trained
        (
            lambda r: r[HANDED_OUT][5].update(status="trained"),
            "group 5 is marked trained but no step trained it",
        ),
    ],
    ids=["twice", "partial", "evicted", "never"],
)
def test_trained_once_and_whole(tmp_path: Path, change: Any, expected: str) -> None:
    run = good_run()
    change(run)
    assert expected in failed(run, tmp_path)["every trained group trained once, whole"]


def test_a_rollout_in_two_steps_is_named(tmp_path: Path) -> None:
    run = good_run()
    run[TRAINED].append(dict(run[TRAINED][3], step=7))
    assert "demo-1_g1 in steps [0, 7]" in failed(run, tmp_path)["no rollout in two steps"]


def test_a_repeated_tool_effect_is_named_even_under_another_call(tmp_path: Path) -> None:
    run = good_run()
    again = dict(run[MUTATIONS][4], call_id="other-call", instance="env-9")
    run[MUTATIONS].append(again)
    detail = failed(run, tmp_path)["every environment mutation applied once"]
    assert f"{again['rollout_id']} turn {again['turn']} applied 2 times" in detail


def test_against_a_reference_compares_every_rollouts_tokens(tmp_path: Path) -> None:
    reference = write(tmp_path / "reference", good_run())
    run = good_run()
    run[TRAINED][2]["tokens_sha256"] = tokens_sha("x", "changed")
    write(tmp_path / "run", run)
    result = CliRunner().invoke(
        app, ["verify", str(tmp_path / "run"), "--against", str(reference), "--json"]
    )
    assert result.exit_code == 1
    payload = json.loads(result.output)
    bad = [c for c in payload["checks"] if not c["ok"]]
    assert [c["name"] for c in bad] == ["tokens identical to the reference run"]
    assert "demo-1_g0 tokens differ" in bad[0]["detail"]
    same = CliRunner().invoke(app, ["verify", str(reference), "--against", str(reference)])
    assert same.exit_code == 0


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        (TRAINED, '{"step": 0}\n', "trained_rows.jsonl:1"),
        (HANDED_OUT, '{"group_idx": 0, "group_id": "g", "status": "lost"}\n', "status"),
        (
            MUTATIONS,
            '{"instance": "a", "rollout_id": "r", "turn": 0, "call_id": "c", "extra": 1}\n',
            "extra",
        ),
        (TRAINED, "not json\n", "trained_rows.jsonl:1"),
    ],
)
def test_malformed_evidence_exits_2_naming_file_and_line(
    tmp_path: Path, name: str, text: str, expected: str
) -> None:
    directory = write(tmp_path / "run", good_run())
    (directory / name).write_text(text)
    with pytest.raises(EvidenceError, match=expected):
        Evidence.read(directory)
    result = CliRunner().invoke(app, ["verify", str(directory)])
    assert result.exit_code == 2 and expected in result.output


def test_missing_evidence_exits_2(tmp_path: Path) -> None:
    directory = write(tmp_path / "run", good_run())
    (directory / HANDED_OUT).unlink()
    result = CliRunner().invoke(app, ["verify", str(directory)])
    assert result.exit_code == 2 and "handed_out.jsonl: missing" in result.output
    assert CliRunner().invoke(app, ["verify", str(tmp_path / "nowhere")]).exit_code == 2


def generation(event: str, at: float, rid: str | None = None, attempt: int = 0) -> dict[str, Any]:
    if rid is None:
        return {"event": event, "at_unix": at}
    return {"event": event, "rollout_id": rid, "attempt": attempt, "at_unix": at}


def with_journal(tmp_path: Path, lines: list[dict[str, Any]]) -> list[Any]:
    run = good_run()
    run[GENERATIONS] = lines
    directory = write(tmp_path / "run", run)
    report = json.loads((directory / REPORT).read_text())
    (directory / REPORT).write_text(json.dumps({**report, "journal": True}))
    return verify(Evidence.read(directory))


def test_with_the_journal_a_rollout_sealed_twice_is_named_with_the_seconds_lost(
    tmp_path: Path,
) -> None:
    lines = [
        generation("started", 100.0, "demo-0_g0"),
        generation("sealed", 104.0, "demo-0_g0"),  # sealed, then lost to the kill
        generation("started", 103.0, "demo-0_g1"),  # in flight when the run was killed
        generation("killed", 105.0),
        generation("started", 110.0, "demo-0_g0", 1),
        generation("sealed", 113.0, "demo-0_g0", 1),
    ]
    check = with_journal(tmp_path, lines)[-1]
    assert check.name == "no sealed rollout generated twice" and not check.ok
    assert "demo-0_g0 sealed 2 times" in check.detail
    found = account_generations(Evidence.read(tmp_path / "run").generations)
    assert (found.lost_s, found.redone_s) == (4.0, 2.0)


def test_with_the_journal_nothing_sealed_twice_passes_and_reports_what_was_redone(
    tmp_path: Path,
) -> None:
    lines = [
        generation("started", 100.0, "demo-0_g0"),
        generation("sealed", 104.0, "demo-0_g0"),
        generation("started", 103.0, "demo-0_g1"),
        generation("killed", 105.5),
        generation("started", 110.0, "demo-0_g1", 1),
        generation("sealed", 112.0, "demo-0_g1", 1),
    ]
    check = with_journal(tmp_path, lines)[-1]
    assert check.ok, check.detail
    assert "0.0 generation-seconds lost" in check.detail and "2.5 in-flight" in check.detail


def test_a_kill_line_naming_a_rollout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EvidenceError, match=r"generations\.jsonl:1"):
        with_journal(tmp_path, [generation("killed", 1.0, "demo-0_g0")])
