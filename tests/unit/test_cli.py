"""`rollsafe scenario run` and `snapshots list` as a user runs them: a separate process, exit
codes, stdout/stderr (in-process for memory://, which lives in one process)."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

SCENARIOS = Path(__file__).parent.parent / "scenarios"


def rollsafe(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollsafe", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def write(path: Path, scenario: dict) -> Path:
    path.write_text(json.dumps(scenario))
    return path


def scenario(*events: dict, **fields) -> dict:
    return {
        "name": "t",
        "sampler": "windowed",
        "group_size": 2,
        "groups_per_step": 1,
        "events": list(events),
        **fields,
    }


def test_runs_a_scenario_and_prints_one_json_object(tmp_path):
    result = rollsafe(
        "scenario", "run", SCENARIOS / "s3_one_batch_part_done.json", "--snapshot-dir", tmp_path
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["loader_position"] == 15
    assert report["groups"]["13"] == {
        "state": "generating",
        "restored_rollouts": [0],
        "regenerate": [1],
    }
    assert any((tmp_path / "scenario" / "snapshots").iterdir())  # really written to disk


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps(scenario(surprise=1)), "surprise: Extra inputs are not permitted"),
        (json.dumps(scenario({"op": "handout", "groups": [1], "x": 2})), "events.0.handout.x"),
        (json.dumps(scenario({"op": "teleport"})), "events.0"),
        (json.dumps({**scenario(), "group_size": "2"}), "group_size"),
        (json.dumps({**scenario(), "sampler": "lifo"}), "sampler"),
    ],
)
def test_malformed_file_exits_2_naming_the_problem(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    result = rollsafe("scenario", "run", path)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([{"op": "restore"}], "event 1 (restore): no snapshot"),
        (
            [{"op": "handout", "groups": [3]}, {"op": "train", "groups": [3]}],
            "event 2 (train): group 3: illegal transition RESERVED -> TRAINED",
        ),
        (
            [{"op": "handout", "groups": [3]}, {"op": "handout", "groups": [2]}],
            "event 2 (handout): handout of [2]: below the loader position 4",
        ),
        (
            [{"op": "crash"}, {"op": "checkpoint"}],
            "event 2 (checkpoint): the run crashed at event 1; only 'restore' can follow",
        ),
        (
            [{"op": "handout", "groups": [3]}, {"op": "commit", "group": 3, "rollouts": [5]}],
            "event 2 (commit): group 3: sibling 5 outside 0..1",
        ),
        ([{"op": "evict", "group": 4}], "event 1 (evict): group 4 is not owned"),
        (
            [{"op": "weight_version", "version": 2}, {"op": "weight_version", "version": 1}],
            "event 2 (weight_version): weight version 1 is older than the current 2",
        ),
    ],
)
def test_impossible_event_exits_2_naming_the_event(tmp_path, events, message):
    result = rollsafe("scenario", "run", write(tmp_path / "s.json", scenario(*events)))
    assert result.returncode == 2
    assert message in result.stderr


def test_unknown_dataplane_and_missing_file_exit_2(tmp_path):
    result = rollsafe("scenario", "run", SCENARIOS / "s1_all_finished.json", "--dataplane", "tq")
    assert result.returncode == 2 and "unknown data plane 'tq'" in result.stderr
    result = rollsafe("scenario", "run", tmp_path / "nope.json")
    assert result.returncode == 2 and "no such file" in result.stderr


def test_a_restored_row_that_differs_exits_1_naming_group_and_rollout(
    tmp_path, resign, flip_a_token
):
    """First process checkpoints and exits (a real crash); the snapshot is altered with every
    digest fixed up; the second process restores and must notice the row."""
    first = scenario(
        {"op": "handout", "groups": [5]},
        {"op": "commit", "group": 5, "rollouts": [0, 1]},
        {"op": "checkpoint"},
    )
    snapshots = tmp_path / "snaps"
    assert (
        rollsafe(
            "scenario", "run", write(tmp_path / "a.json", first), "--snapshot-dir", snapshots
        ).returncode
        == 0
    )
    (snapshot,) = (snapshots / "scenario" / "snapshots").iterdir()
    shard = next((snapshot / "dataplane").rglob("*.safetensors"))
    resign(snapshot, str(shard.relative_to(snapshot)), flip_a_token)
    second = write(tmp_path / "b.json", scenario({"op": "restore"}))
    result = rollsafe("scenario", "run", second, "--snapshot-dir", snapshots)
    assert result.returncode == 1, result.stderr
    assert "group 5 rollout 0 (scenario-5_g0)" in result.stderr
    assert result.stdout == ""


def test_a_later_process_continues_from_the_snapshot(tmp_path):
    snapshots = tmp_path / "snaps"
    first = scenario(
        {"op": "handout", "groups": [5, 6]},
        {"op": "commit", "group": 5, "rollouts": [0]},
        {"op": "checkpoint"},
    )
    assert (
        rollsafe(
            "scenario", "run", write(tmp_path / "a.json", first), "--snapshot-dir", snapshots
        ).returncode
        == 0
    )
    second = scenario({"op": "restore"}, {"op": "commit", "group": 5, "rollouts": [1]})
    result = rollsafe(
        "scenario", "run", write(tmp_path / "b.json", second), "--snapshot-dir", snapshots
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["groups"]["5"]["state"] == "ready"
    assert report["next_selection"] == [5]


def test_snapshots_list_shows_each_snapshot_and_why_it_is_refused(tmp_path):
    snapshots = tmp_path / "snaps"
    run = scenario({"op": "handout", "groups": [1]}, {"op": "checkpoint"}, {"op": "checkpoint"})
    assert (
        rollsafe(
            "scenario", "run", write(tmp_path / "a.json", run), "--snapshot-dir", snapshots
        ).returncode
        == 0
    )
    listing = rollsafe("snapshots", "list", snapshots, "--run", "scenario")
    assert listing.returncode == 0, listing.stderr
    assert "00000001-rollout" in listing.stdout and "00000002-rollout" in listing.stdout
    newest = snapshots / "scenario" / "snapshots" / "00000002-rollout" / "ledger.safetensors"
    newest.write_bytes(newest.read_bytes()[:-1])
    listing = rollsafe("snapshots", "list", snapshots, "--run", "scenario")
    assert listing.returncode == 0  # the older one still verifies
    assert "invalid" in listing.stdout and "ledger.safetensors" in listing.stdout
    older = snapshots / "scenario" / "snapshots" / "00000001-rollout" / "run.json"
    older.unlink()
    listing = rollsafe("snapshots", "list", snapshots, "--run", "scenario")
    assert listing.returncode == 1 and "verifies" in listing.stderr


def test_snapshots_list_and_ls_take_a_file_url(tmp_path):
    snapshots = tmp_path / "snaps"
    run = scenario({"op": "handout", "groups": [1]}, {"op": "checkpoint"})
    written = rollsafe(
        "scenario", "run", write(tmp_path / "a.json", run), "--snapshot-dir", snapshots
    )
    assert written.returncode == 0, written.stderr
    listing = rollsafe("snapshots", "list", f"file://{snapshots}", "--run", "scenario")
    assert listing.returncode == 0, listing.stderr
    assert "00000001-rollout" in listing.stdout and "valid" in listing.stdout
    ls = subprocess.run(
        [sys.executable, "-m", "rollsafe", "ls", "scenario"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "ROLLSAFE_SNAPSHOT_ROOT": f"file://{snapshots}"},
    )
    assert ls.returncode == 0, ls.stderr
    assert "00000001-rollout" in ls.stdout


def test_snapshots_list_and_ls_read_object_storage(tmp_path):
    """memory:// lives in this process only, so the command runs in it (CliRunner)."""
    fsspec = pytest.importorskip("fsspec")
    from typer.testing import CliRunner

    from rollsafe.cli.app import app
    from rollsafe.snapshot import SnapshotKind
    from rollsafe.snapshot.remote import RemoteSnapshotStore

    url = f"memory://rollsafe-cli-{uuid.uuid4().hex[:12]}/snaps"
    store = RemoteSnapshotStore(url, "cli-run", tmp_path / "writer")
    for checkpoint in ("ck-1", "ck-2"):
        draft = store.begin(SnapshotKind.ROLLOUT, checkpoint)
        draft.write_bytes("state.bin", checkpoint.encode())
        draft.publish(weight_version=1, loader_position=1)
    try:
        runner = CliRunner()
        listing = runner.invoke(app, ["snapshots", "list", url, "--run", "cli-run"])
        assert listing.exit_code == 0, listing.output
        assert "00000002-rollout" in listing.output and "00000001-rollout" in listing.output
        assert "ck-2" in listing.output and "invalid" not in listing.output
        # damage the newest: it is named invalid, the older one still verifies
        store.fs.pipe_file(f"{store.remote_run}/snapshots/00000002-rollout/state.bin", b"ck-X")
        ls = runner.invoke(app, ["ls", "cli-run"], env={"ROLLSAFE_SNAPSHOT_ROOT": url})
        assert ls.exit_code == 0, ls.output
        assert "invalid" in ls.output and "sha256" in ls.output
        before = sorted(store.fs.find(store.remote_run))
        runner.invoke(app, ["snapshots", "list", url, "--run", "cli-run"])
        assert sorted(store.fs.find(store.remote_run)) == before  # read-only
        other = runner.invoke(app, ["snapshots", "list", url, "--run", "no-such-run"])
        assert other.exit_code == 1 and "verifies" in other.output
        odd = runner.invoke(app, ["snapshots", "list", "ftp://host/x", "--run", "cli-run"])
        assert odd.exit_code == 2 and "unsupported snapshot storage scheme 'ftp'" in odd.output
    finally:
        fs = fsspec.filesystem("memory")
        root = fs._strip_protocol(url).split("/")[1]
        if fs.exists(f"/{root}"):
            fs.rm(f"/{root}", recursive=True)
