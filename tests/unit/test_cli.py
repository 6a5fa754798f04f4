"""The `rollsafe` command as a user runs it: `scenario run` and `snapshot list` in a separate
process (exit codes, stdout/stderr); the conventions every command keeps (`--version`, `--json`,
exit codes 0/1/2, choices, tokens from a variable or a file, one line and no traceback on a
failure) in process with typer's CliRunner, which memory:// object storage needs too."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, get_args

import pytest

from rollsafe.versions import CONTRACT, THIS

if TYPE_CHECKING:
    from typer.testing import Result

    from rollsafe.core.phases import RestorePlan
    from rollsafe.snapshot import SnapshotStore
    from rollsafe.temporal.pollers import WorkerPresence
    from rollsafe.workflows.models import SnapshotOutcome

SCENARIOS = Path(__file__).parent.parent / "scenarios"


def rollsafe(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollsafe", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def write(path: Path, scenario: dict[str, Any]) -> Path:
    path.write_text(json.dumps(scenario))
    return path


def scenario(*events: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "name": "t",
        "sampler": "windowed",
        "group_size": 2,
        "groups_per_step": 1,
        "events": list(events),
        **fields,
    }


def test_runs_a_scenario_and_prints_one_json_object(tmp_path: Path) -> None:
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
def test_malformed_file_exits_2_naming_the_problem(
    tmp_path: Path, content: str, message: str
) -> None:
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
def test_impossible_event_exits_2_naming_the_event(
    tmp_path: Path, events: list[dict[str, Any]], message: str
) -> None:
    result = rollsafe("scenario", "run", write(tmp_path / "s.json", scenario(*events)))
    assert result.returncode == 2
    assert message in result.stderr


def test_unknown_dataplane_and_missing_file_exit_2(tmp_path: Path) -> None:
    result = rollsafe("scenario", "run", SCENARIOS / "s1_all_finished.json", "--dataplane", "tq")
    assert result.returncode == 2 and "'tq' is not one of 'memory'" in result.stderr
    result = rollsafe("scenario", "run", tmp_path / "nope.json")
    assert result.returncode == 2 and "no such file" in result.stderr


def test_a_restored_row_that_differs_exits_1_naming_group_and_rollout(
    tmp_path: Path,
    resign: Callable[[Path, str, Callable[[bytes], bytes]], None],
    flip_a_token: Callable[[bytes], bytes],
) -> None:
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


def test_a_later_process_continues_from_the_snapshot(tmp_path: Path) -> None:
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


def test_snapshots_list_shows_each_snapshot_and_why_it_is_refused(tmp_path: Path) -> None:
    snapshots = tmp_path / "snaps"
    run = scenario({"op": "handout", "groups": [1]}, {"op": "checkpoint"}, {"op": "checkpoint"})
    assert (
        rollsafe(
            "scenario", "run", write(tmp_path / "a.json", run), "--snapshot-dir", snapshots
        ).returncode
        == 0
    )
    listing = rollsafe("snapshot", "list", "scenario", "--root", snapshots)
    assert listing.returncode == 0, listing.stderr
    assert "00000001-rollout" in listing.stdout and "00000002-rollout" in listing.stdout
    newest = snapshots / "scenario" / "snapshots" / "00000002-rollout" / "ledger.safetensors"
    newest.write_bytes(newest.read_bytes()[:-1])
    listing = rollsafe("snapshot", "list", "scenario", "--root", snapshots)
    assert listing.returncode == 0  # the older one still verifies
    assert "invalid" in listing.stdout and "ledger.safetensors" in listing.stdout
    older = snapshots / "scenario" / "snapshots" / "00000001-rollout" / "run.json"
    older.unlink()
    listing = rollsafe("snapshot", "list", "scenario", "--root", snapshots)
    assert listing.returncode == 1 and "verifies" in listing.stderr


def test_snapshots_list_and_ls_take_a_file_url(tmp_path: Path) -> None:
    snapshots = tmp_path / "snaps"
    run = scenario({"op": "handout", "groups": [1]}, {"op": "checkpoint"})
    written = rollsafe(
        "scenario", "run", write(tmp_path / "a.json", run), "--snapshot-dir", snapshots
    )
    assert written.returncode == 0, written.stderr
    # `snapshots` (the old name of the group) still works
    listing = rollsafe("snapshots", "list", "scenario", "--root", f"file://{snapshots}")
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


def test_snapshots_list_and_ls_read_object_storage(tmp_path: Path) -> None:
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
        listing = runner.invoke(app, ["snapshot", "list", "cli-run", "--root", url])
        assert listing.exit_code == 0, listing.output
        assert "00000002-rollout" in listing.output and "00000001-rollout" in listing.output
        assert "ck-2" in listing.output and "invalid" not in listing.output
        # damage the newest: it is named invalid, the older one still verifies
        store.fs.pipe_file(f"{store.remote_run}/snapshots/00000002-rollout/state.bin", b"ck-X")
        ls = runner.invoke(app, ["ls", "cli-run"], env={"ROLLSAFE_SNAPSHOT_ROOT": url})
        assert ls.exit_code == 0, ls.output
        assert "invalid" in ls.output and "sha256" in ls.output
        before = sorted(store.fs.find(store.remote_run))
        runner.invoke(app, ["snapshot", "list", "cli-run", "--root", url])
        assert sorted(store.fs.find(store.remote_run)) == before  # read-only
        other = runner.invoke(app, ["snapshot", "list", "no-such-run", "--root", url])
        assert other.exit_code == 1 and "verifies" in other.output
        odd = runner.invoke(app, ["snapshot", "list", "cli-run", "--root", "ftp://host/x"])
        assert odd.exit_code == 2 and "unsupported snapshot storage scheme 'ftp'" in odd.output
    finally:
        fs = fsspec.filesystem("memory")
        root = fs._strip_protocol(url).split("/")[1]
        if fs.exists(f"/{root}"):
            fs.rm(f"/{root}", recursive=True)


# -- conventions every command keeps (in process) ----------------------------------------------

RUN = "cli-run"
NO_PROFILE = {  # Temporal found from these variables alone: no user profile leaks in
    "TEMPORAL_CONFIG_FILE": "/nonexistent/temporal.toml",
    "TEMPORAL_PROFILE": None,
    "TEMPORAL_NAMESPACE": "default",
}


def invoke(*args: str | Path, env: Mapping[str, str | None] | None = None) -> "Result":
    from typer.testing import CliRunner

    from rollsafe.cli.app import app

    return CliRunner().invoke(app, [str(arg) for arg in args], env=env)


def one_line_error(result: "Result") -> str:
    """The failure's stderr, checked to be one line and no traceback."""
    assert "Traceback" not in result.output, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A port bound and never listened on: a connect is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def publish(root: Path, *checkpoints: str, run: str = RUN) -> "SnapshotStore":
    from rollsafe.snapshot import SnapshotKind, SnapshotStore

    store = SnapshotStore(root, run)
    for checkpoint in checkpoints:
        draft = store.begin(SnapshotKind.ROLLOUT, checkpoint)
        draft.write_bytes("state.bin", checkpoint.encode())
        draft.publish(weight_version=1, loader_position=1)
    return store


def test_version_prints_the_release_and_its_contract() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout == f"rollsafe {THIS.release} (contract {CONTRACT}: docs/upgrading.md)\n"


# --- snapshot list / ls


def test_snapshot_list_and_ls_print_the_same_json_and_nothing_else(tmp_path: Path) -> None:
    publish(tmp_path, "ck-1", "ck-2")
    listed = invoke("snapshot", "list", RUN, "--root", tmp_path, "--json")
    ls = invoke("ls", RUN, "--json", env={"ROLLSAFE_SNAPSHOT_ROOT": str(tmp_path)})
    assert listed.exit_code == 0 and ls.exit_code == 0, listed.output + ls.output
    assert json.loads(listed.stdout) == json.loads(ls.stdout)  # stdout is the document alone
    payload = json.loads(listed.stdout)
    assert [row["name"] for row in payload["snapshots"]] == ["00000002-rollout", "00000001-rollout"]
    assert [row["state"] for row in payload["snapshots"]] == ["valid", "valid"]
    assert payload["snapshots"][0]["checkpoint_id"] == "ck-2"


def test_no_snapshot_that_verifies_exits_1_with_the_json_still_printed(tmp_path: Path) -> None:
    store = publish(tmp_path, "ck-1")
    (store.snapshots_dir / "00000001-rollout" / "state.bin").write_bytes(b"ck-X")
    result = invoke("snapshot", "list", RUN, "--root", tmp_path, "--json")
    assert result.exit_code == 1
    (row,) = json.loads(result.stdout)["snapshots"]
    assert row["state"] == "invalid" and "state.bin" in row["reason"]
    assert "verifies" in one_line_error(result)
    unchecked = invoke("ls", RUN, "--root", tmp_path, "--no-verify", "--json")
    assert unchecked.exit_code == 0  # names only: nothing claimed about the content
    assert [r["state"] for r in json.loads(unchecked.stdout)["snapshots"]] == ["unchecked"]


def test_ls_needs_a_root_from_the_flag_or_the_variable(tmp_path: Path) -> None:
    missing = invoke("ls", RUN, env={"ROLLSAFE_SNAPSHOT_ROOT": None})
    assert missing.exit_code == 2 and "ROLLSAFE_SNAPSHOT_ROOT" in missing.output
    publish(tmp_path, "ck-1")
    found = invoke("ls", RUN, env={"ROLLSAFE_SNAPSHOT_ROOT": str(tmp_path)})
    assert found.exit_code == 0 and "00000001-rollout" in found.stdout
    bad_run = invoke("ls", "no such run", "--root", tmp_path)
    assert bad_run.exit_code == 2 and "invalid run id" in one_line_error(bad_run)


def test_object_storage_is_verified_one_snapshot_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each snapshot downloaded advances the progress (drawn on a terminal only)."""
    fsspec = pytest.importorskip("fsspec")
    from rollsafe.snapshot import SnapshotKind
    from rollsafe.snapshot.remote import RemoteSnapshotStore

    seen: dict[str, int | None] = {"advanced": 0}

    @contextlib.contextmanager
    def recorded(description: str, total: int | None = None) -> Iterator[Callable[[], None]]:
        seen["total"] = total

        def advance() -> None:
            advanced = seen["advanced"]
            assert advanced is not None
            seen["advanced"] = advanced + 1

        yield advance

    monkeypatch.setattr("rollsafe.cli.snapshots.progress", recorded)
    url = f"memory://rollsafe-cli-{uuid.uuid4().hex[:12]}/snaps"
    store = RemoteSnapshotStore(url, RUN, tmp_path / "writer")
    for checkpoint in ("ck-1", "ck-2"):  # retention keeps two
        draft = store.begin(SnapshotKind.ROLLOUT, checkpoint)
        draft.write_bytes("state.bin", checkpoint.encode())
        draft.publish(weight_version=1, loader_position=1)
    store.fs.pipe_file(f"{store.remote_run}/snapshots/00000002-rollout/state.bin", b"ck-X")
    try:
        result = invoke("ls", RUN, "--root", url, "--json")
    finally:
        fs = fsspec.filesystem("memory")
        fs.rm(f"/{fs._strip_protocol(url).split('/')[1]}", recursive=True)
    assert result.exit_code == 0, result.output
    states = [row["state"] for row in json.loads(result.stdout)["snapshots"]]
    assert states == ["invalid", "valid"]
    assert seen == {"total": 2, "advanced": 2}


# --- exit 2 for usage errors: choices, ports


@pytest.mark.parametrize(
    "args",
    [
        ("engine", "serve", "--port", "0", "--backend", "tgi"),
        ("engine", "serve", "--port", "0", "--dtype", "float16"),
        ("engine", "make-model", "/nonexistent/m", "--arch", "huge"),
        ("scenario", "run", "/nonexistent/s.json", "--dataplane", "tq"),
        ("demo", "--restore-level", "everything"),
        ("demo", "--sampler", "lifo"),
        ("demo", "--engine", "tgi"),
        ("demo", "--gym", "math"),
    ],
)
def test_a_value_outside_a_choice_is_a_usage_error(args: tuple[str, ...]) -> None:
    result = invoke(*args)
    assert result.exit_code == 2
    assert "is not one of" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("scenario", "run", "/"), "is a directory"),
        (("env-check", "localhost:8400"), "give http://host:port"),
        (("env-check", "http://127.0.0.1:9"), "--task is required"),
        (("env", "serve", "workplace", "--port", "0", "--hooks-option", "a=b"), "for --hooks"),
        (("demo", "--interval-s", "0"), "interval_s: Input should be greater than 0"),
        (("demo", "--deterministic", "--sampler", "windowed"), "cannot use sampler windowed"),
        (("demo", "--fault", "temporal@nowhere"), "the phase must be one of open,"),
        (("demo", "--fault", "env-lost@step0"), "expected env-lost@step<k>, k >= 1"),
        (("demo", "--fault", "run@step2", "--fault", "env-lost@step2"), "at each step"),
        (("demo", "--fault", "temporal@drain", "--fault", "coordinator@drain"), "different"),
        (("demo", "--steps", "2", "--fault", "env-lost@step3"), "has only 2 steps"),
        (("demo", "--gym", "workplace_assistant", "--engine", "vllm"), "--engine does not apply"),
        (("demo", "--gym", "workplace_assistant", "--fault", "env@prepare"), "not ['env@prepare']"),
        # --gym's own default faults (run@step2, kill@step3) checked against its steps
        (("demo", "--gym", "workplace_assistant", "--steps", "2"), "kill@step3: the run has only"),
    ],
)
def test_a_bad_argument_found_by_the_command_is_a_usage_error(
    args: tuple[str, ...], message: str
) -> None:
    result = invoke(*args, env={"ROLLSAFE_ENV_TOKEN": "t"})
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output and "errors.pydantic.dev" not in result.output


def test_a_model_directory_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    result = invoke("engine", "make-model", tmp_path / "a-file" / "model")
    assert result.exit_code == 1
    assert "cannot write the model under" in one_line_error(result)


def test_help_lists_the_choices() -> None:
    wide = {"COLUMNS": "200"}  # each metavar on one line
    serve = invoke("engine", "serve", "--help", env=wide).output
    assert "reference|vllm" in serve and "float32|bfloat16" in serve
    demo = invoke("demo", "--help", env=wide).output
    assert "prompt_group|sibling|turn|prefix" in demo and "windowed|in_order|weight_fifo" in demo


def test_the_dtypes_spelled_in_the_cli_are_the_engines() -> None:
    from rollsafe.cli import engine as cli_engine
    from rollsafe.engine.vllm.engine import Dtype

    assert get_args(cli_engine.Dtype) == get_args(Dtype)


@pytest.mark.parametrize(
    "args",
    [
        ("engine", "serve", "--port", "99999"),
        ("env", "serve", "workplace", "--port", "99999"),
        ("server", "--port", "-1"),
        ("worker", "--run", RUN, "--health-port", "70000"),
    ],
)
def test_a_port_out_of_range_is_a_usage_error(args: tuple[str, ...]) -> None:
    result = invoke(*args, env={"ROLLSAFE_ENGINE_TOKEN": "t", "ROLLSAFE_ENV_TOKEN": "t"})
    assert result.exit_code == 2
    assert "Invalid value for '--" in result.output and "port" in result.output


# --- tokens: a variable or a file, never needed on a command line

GATEWAY = ("gateway", "serve", "--port", "0", "--model", "m", "--engine-url", "http://x")


@pytest.fixture
def served_tokens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`engine serve` with the engine and the server replaced: the token it would serve with."""
    tokens: list[str] = []

    async def serve(engine: object, host: str, port: int, token: str) -> None:
        tokens.append(token)

    monkeypatch.setattr("rollsafe.engine.http.serve", serve)
    monkeypatch.setattr("rollsafe.cli.engine._engine", lambda *args: object())
    return tokens


def test_a_token_file_is_read_stripped_and_beats_the_variable(
    tmp_path: Path, served_tokens: list[str]
) -> None:
    file = tmp_path / "token"
    file.write_text("  from-the-file\n")
    env = {"ROLLSAFE_ENGINE_TOKEN": "from-the-variable"}
    assert invoke("engine", "serve", "--port", "0", env=env).exit_code == 0
    assert invoke("engine", "serve", "--port", "0", "--token-file", file, env=env).exit_code == 0
    assert served_tokens == ["from-the-variable", "from-the-file"]


@pytest.mark.parametrize(
    ("content", "message"),
    [("", "is empty"), ("\n \n", "is empty"), (None, "cannot read it")],
)
def test_an_empty_or_missing_token_file_is_a_usage_error(
    tmp_path: Path, served_tokens: list[str], content: str | None, message: str
) -> None:
    file = tmp_path / "token"
    if content is not None:
        file.write_text(content)
    result = invoke("engine", "serve", "--port", "0", "--token-file", file)
    assert result.exit_code == 2 and message in one_line_error(result)
    assert served_tokens == []


SECRET = "s3cr3t-never-echoed"


@pytest.mark.parametrize(
    ("args", "flag", "variable"),
    [
        (("engine", "serve", "--port", "0"), "--token", "ROLLSAFE_ENGINE_TOKEN"),
        (("env", "serve", "workplace", "--port", "0"), "--token", "ROLLSAFE_ENV_TOKEN"),
        (("env-check", "http://127.0.0.1:9"), "--token", "ROLLSAFE_ENV_TOKEN"),
        (("env-check", "http://127.0.0.1:9"), "--engine-token", "ROLLSAFE_ENGINE_TOKEN"),
        (("env", "serve", "workplace", "--port", "0"), "--engine-token", "ROLLSAFE_ENGINE_TOKEN"),
        (GATEWAY, "--token", "ROLLSAFE_ENV_TOKEN"),
        (GATEWAY, "--engine-token", "ROLLSAFE_ENGINE_TOKEN"),
        (GATEWAY, "--api-token", "ROLLSAFE_GATEWAY_TOKEN"),
    ],
)
@pytest.mark.parametrize("spelling", ["apart", "joined"])
def test_a_token_on_the_command_line_is_refused_naming_the_variable(
    served_tokens: list[str], args: tuple[str, ...], flag: str, variable: str, spelling: str
) -> None:
    typed = (flag, SECRET) if spelling == "apart" else (f"{flag}={SECRET}",)
    result = invoke(*args, *typed, env={"ROLLSAFE_ENGINE_TOKEN": "e", "ROLLSAFE_ENV_TOKEN": "t"})
    assert result.exit_code == 2
    line = one_line_error(result)
    assert line.startswith(f"error: {flag} is not accepted: ")
    assert variable in line and f"{flag}-file" in line and "ps" in line
    assert SECRET not in result.output
    assert served_tokens == []


@pytest.mark.parametrize("command", [("engine", "serve"), ("env", "serve"), ("env-check",)])
def test_help_offers_no_token_value_flag(command: tuple[str, ...]) -> None:
    shown = invoke(*command, "--help", env={"COLUMNS": "200"}).output
    assert "--token-file" in shown
    assert "--token " not in shown and "--engine-token " not in shown


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_token_variable_is_a_usage_error(served_tokens: list[str], value: str) -> None:
    result = invoke("engine", "serve", "--port", "0", env={"ROLLSAFE_ENGINE_TOKEN": value})
    assert result.exit_code == 2
    assert "ROLLSAFE_ENGINE_TOKEN must not be empty" in one_line_error(result)
    assert served_tokens == []


def test_no_token_at_all_names_the_variable_and_the_file(served_tokens: list[str]) -> None:
    result = invoke("engine", "serve", "--port", "0", env={"ROLLSAFE_ENGINE_TOKEN": None})
    assert result.exit_code == 2
    line = one_line_error(result)
    assert "ROLLSAFE_ENGINE_TOKEN" in line and "--token-file" in line


# --- worker: the run id first, Ray's absence in one line


@pytest.fixture
def no_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the worker would start."""

    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise AssertionError("the worker started")

    monkeypatch.setattr("rollsafe.workers.checkpoint.run_worker", refuse)


def test_worker_checks_the_run_id_before_touching_ray(
    monkeypatch: pytest.MonkeyPatch, no_worker: None
) -> None:
    def refuse(*args: object) -> NoReturn:
        raise AssertionError("Ray was looked for")

    monkeypatch.setattr("rollsafe.cli.doctor.checks.check_ray", refuse)
    result = invoke("worker", "--run", "not a run id")
    assert result.exit_code == 2 and "invalid run id" in one_line_error(result)


def test_worker_without_ray_says_how_to_start_it(dead_port: int, no_worker: None) -> None:
    result = invoke("worker", "--run", RUN, "--ray-address", f"127.0.0.1:{dead_port}")
    assert result.exit_code == 1
    line = one_line_error(result)
    assert f"127.0.0.1:{dead_port}" in line and "ray start --head" in line
    assert "RAY_ADDRESS" in line


def test_worker_turns_rays_own_join_error_into_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray found by the pre-check but refusing the join: its ConnectionError, in one line."""
    from rollsafe.cli import app as cli_app

    async def ray_refuses(*args: object, **kwargs: object) -> NoReturn:
        raise ConnectionError("Could not find any running Ray instance. Please set `--address`")

    monkeypatch.setattr(cli_app, "_ray_problem", lambda address: None)
    monkeypatch.setattr("rollsafe.workers.checkpoint.run_worker", ray_refuses)
    monkeypatch.setattr(cli_app, "_ray_joined", lambda: False)
    result = invoke("worker", "--run", RUN, "--ray-address", "10.0.0.1:6379")
    assert result.exit_code == 1
    line = one_line_error(result)
    assert "cannot join Ray at 10.0.0.1:6379: Could not find any running Ray instance" in line
    assert "--address`" not in line and "ray start --head" in line
    # Once Ray was joined, the same error is not Ray's join: it keeps its traceback.
    monkeypatch.setattr(cli_app, "_ray_joined", lambda: True)
    joined = invoke("worker", "--run", RUN, "--ray-address", "10.0.0.1:6379")
    assert isinstance(joined.exception, ConnectionError)


# --- snapshot now, restore, inspect: Temporal's absence in one line; --json


def test_temporal_unreachable_is_one_line_naming_the_address(dead_port: int) -> None:
    env = {**NO_PROFILE, "TEMPORAL_ADDRESS": f"127.0.0.1:{dead_port}"}
    for args in (("inspect", RUN), ("snapshot", "now", RUN), ("restore", RUN, "--json")):
        result = invoke(*args, env=env)
        assert result.exit_code == 1, (args, result.output)
        line = one_line_error(result)
        assert f"127.0.0.1:{dead_port}" in line and "TEMPORAL_ADDRESS" in line
        assert result.stdout == ""


@pytest.mark.parametrize("args", [("inspect",), ("snapshot", "now"), ("restore",)])
def test_a_bad_run_id_is_refused_before_connecting(
    monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]
) -> None:
    async def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise AssertionError("connected")

    monkeypatch.setattr("rollsafe.temporal.connect.connect", refuse)
    result = invoke(*args, "no/such run")
    assert result.exit_code == 2 and "invalid run id" in one_line_error(result)


class FakeCheckpointer:
    """The SDK's Checkpointer with the answers a test sets; records what it was asked."""

    outcome: "SnapshotOutcome | None" = None
    plan: "RestorePlan | None" = None
    error: Exception | None = None
    workers_present = True
    asked: ClassVar[list[tuple[Any, ...]]] = []  # (method, arguments...): mixed types

    def __init__(self, run_id: str, *, client: object) -> None:
        self.run_id = run_id

    async def workers(self) -> "WorkerPresence":
        from rollsafe.temporal.pollers import WorkerPresence

        age = 1.0 if self.workers_present else None
        return WorkerPresence(
            task_queue=f"rollsafe.{self.run_id}", pollers=1, newest_poll_age_s=age, seen_within_s=90
        )

    async def snapshot_now(self, timeout: float | None = None) -> "SnapshotOutcome | None":  # noqa: ASYNC109 - the SDK's signature
        self.asked.append(("snapshot_now", timeout))
        if self.error is not None:
            raise self.error
        return self.outcome

    async def restore(
        self,
        restore_id: str,
        weight_versions: Sequence[int] | None = None,
        *,
        accept_journal_loss: bool = False,
    ) -> "RestorePlan | None":
        self.asked.append(("restore", restore_id, weight_versions, accept_journal_loss))
        return self.plan


@pytest.fixture
def checkpointer(monkeypatch: pytest.MonkeyPatch) -> type[FakeCheckpointer]:
    async def connect(*args: object, **kwargs: object) -> object:
        return object()

    monkeypatch.setattr("rollsafe.temporal.connect.connect", connect)
    fake = type("Fake", (FakeCheckpointer,), {"asked": []})
    monkeypatch.setattr("rollsafe.client.Checkpointer", fake)
    return fake


def outcome(status: str, reason: str = "") -> "SnapshotOutcome":
    from rollsafe.core.phases import PublishedSnapshotInfo
    from rollsafe.workflows.models import SnapshotOutcome

    published = PublishedSnapshotInfo(
        name="00000004-rollout",
        path="/snaps/00000004-rollout",
        checkpoint_id=f"{RUN}.rollout.00000004",
        manifest_sha256="0" * 64,
        weight_version=7,
        loader_position=40,
    )
    return SnapshotOutcome(
        checkpoint_id=f"{RUN}.rollout.00000004",
        seq=4,
        status=status,
        reason=reason,
        published=published if status == "published" else None,
    )


def test_snapshot_now_prints_the_outcome_and_fails_unless_published(
    checkpointer: type[FakeCheckpointer],
) -> None:
    from rollsafe.workflows.models import SnapshotOutcome

    checkpointer.outcome = outcome("published")
    done = invoke("snapshot", "now", RUN, "--timeout", "30", "--json")
    assert done.exit_code == 0, done.output
    assert SnapshotOutcome.model_validate_json(done.stdout) == checkpointer.outcome
    assert checkpointer.asked == [("snapshot_now", 30.0)]
    checkpointer.outcome = outcome("skipped", "trainer_state_changed: step 9 committed")
    skipped = invoke("snapshot", "now", RUN)
    assert skipped.exit_code == 1
    assert "snapshot 4 skipped: trainer_state_changed: step 9 committed" in skipped.stdout


def test_snapshot_now_without_a_supervisor_is_one_line(
    checkpointer: type[FakeCheckpointer],
) -> None:
    from rollsafe.errors import SupervisorNotRunning

    checkpointer.error = SupervisorNotRunning(f"run {RUN!r} has no checkpoint supervisor")
    result = invoke("snapshot", "now", RUN)
    assert result.exit_code == 1
    assert "has no checkpoint supervisor" in one_line_error(result)


def test_restore_passes_its_id_and_weight_versions_and_prints_the_plan(
    checkpointer: type[FakeCheckpointer],
) -> None:
    from rollsafe.core.phases import RestorePlan

    checkpointer.plan = RestorePlan(
        snapshot="00000004-rollout",
        checkpoint_id=f"{RUN}.rollout.00000004",
        skipped={"00000005-rollout": "not accepted: weight version 9"},
        loader_position=40,
        weight_version=7,
        ready=[3],
        partial={},
        released_claims=[],
        redispatch=[],
    )
    args = ("restore", RUN, "--restore-id", "r1", "--weight-version", "7", "--weight-version", "9")
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    assert RestorePlan.model_validate_json(result.stdout) == checkpointer.plan
    assert checkpointer.asked == [("restore", "r1", [7, 9], False)]
    text = invoke("restore", RUN, "--accept-journal-loss")  # a fresh id, printed for a retry
    (_, minted, _, accepted) = checkpointer.asked[-1]
    assert accepted
    assert minted.startswith("cli-") and f"restore id {minted}" in text.stdout
    assert "00000005-rollout refused: not accepted: weight version 9" in text.stdout


def test_a_run_no_worker_serves_is_warned_on_stderr(checkpointer: type[FakeCheckpointer]) -> None:
    checkpointer.workers_present = False
    checkpointer.outcome = outcome("published")
    result = invoke("snapshot", "now", RUN, "--json")
    assert result.exit_code == 0
    assert "no checkpoint worker polls task queue 'rollsafe.cli-run'" in result.stderr
    json.loads(result.stdout)  # the warning stays off stdout


def test_inspect_json_is_the_view(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollsafe.cli.inspection import RunView

    async def connect(*args: object, **kwargs: object) -> object:
        return object()

    async def inspect_run(client: object, run_id: str) -> RunView:
        return RunView(run_id=run_id, supervisor="absent")

    monkeypatch.setattr("rollsafe.temporal.connect.connect", connect)
    monkeypatch.setattr("rollsafe.cli.inspection.inspect_run", inspect_run)
    result = invoke("inspect", RUN, "--json")
    assert result.exit_code == 0, result.output
    assert RunView.model_validate_json(result.stdout) == RunView(run_id=RUN, supervisor="absent")


def test_inspect_says_a_run_is_parked_where_it_is_stuck_and_that_it_is_not_checkpointed() -> None:
    from rollsafe.cli.inspection import RunView, SnapshotView, render
    from rollsafe.workflows.models import SupervisorState, SupervisorStatus

    state = SupervisorState(skipped=1, failed=2, unpublished_in_a_row=3)
    status = SupervisorStatus(
        run_id=RUN,
        state=state,
        running_seq=4,
        running_workflow_id=f"rollsafe/{RUN}/snapshot/4",
        queued_requests=0,
        warning="3 snapshots in a row ended unpublished (no snapshot published yet: ...)",
    )
    snap = SnapshotView(
        workflow_id=f"rollsafe/{RUN}/snapshot/4",
        kind="rollout",
        phase="drain",
        running_for_s=42.0,
        pending=[],
        worker="41@stuck-host",
        parked_since=0.0,
        task_attempts=3,
        task_trouble="timed out on worker 41@stuck-host: start_to_close",
        reported_problems=["category=WorkflowTaskTimedOut"],
    )
    text = render(RunView(run_id=RUN, supervisor="RUNNING", status=status, snapshots=[snap]))
    assert "  not being checkpointed: 3 snapshots in a row ended unpublished" in text
    assert (
        f"rollsafe/{RUN}/snapshot/4: phase drain, running 42.0 s, held by worker 41@stuck-host"
        in text
    )
    assert "the run is parked: admission closed since 00:00:00 UTC by this snapshot" in text
    assert (
        "workflow task attempt 3; the last one timed out on worker 41@stuck-host: start_to_close"
        in text
    )
    assert "server reports: category=WorkflowTaskTimedOut" in text


def test_verify_of_missing_evidence_is_a_usage_error_with_nothing_on_stdout(tmp_path: Path) -> None:
    result = invoke("verify", tmp_path / "nowhere", "--json")
    assert result.exit_code == 2 and result.stdout == ""
    one_line_error(result)


def test_config_show_names_each_value_and_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from rollsafe.cli.app import app

    settings = tmp_path / "train.yaml"
    settings.write_text("trainer: {lr: 1e-5}\nrollsafe:\n  run: {group_size: 8}\n")
    monkeypatch.setenv("ROLLSAFE_CONFIG", str(settings))
    monkeypatch.setenv("ROLLSAFE_RUN_ID", "shown")
    monkeypatch.setenv("TEMPORAL_API_KEY", "sekrit-key")
    shown = CliRunner().invoke(app, ["config", "show", "--json"])
    assert shown.exit_code == 0, shown.output
    rows = {row["key"]: row for row in json.loads(shown.stdout)}
    assert rows["run_id"] == {"key": "run_id", "value": "shown", "source": "env ROLLSAFE_RUN_ID"}
    assert rows["run.group_size"]["source"] == f"file {settings}"
    assert rows["snapshots.keep_latest_k"]["source"] == "default"
    assert rows["temporal.api_key"] == {
        "key": "temporal.api_key",
        "value": "**********",
        "source": "env TEMPORAL_API_KEY",
    }
    assert "sekrit" not in shown.output

    monkeypatch.setenv("ROLLSAFE_SNAPSHOTS__KEEP", "3")
    refused = CliRunner().invoke(app, ["config", "show"])
    assert refused.exit_code == 2
    assert "unknown key 'snapshots.keep' (from env ROLLSAFE_SNAPSHOTS__KEEP)" in refused.output


@pytest.mark.parametrize("command", [["worker", "--run", "r"], ["engine", "serve", "--port", "0"]])
def test_long_running_commands_take_log_flags_with_choices(command: list[str]) -> None:
    from typer.testing import CliRunner

    from rollsafe.cli.app import app

    wrong = CliRunner().invoke(app, [*command, "--log-level", "verbose"])
    assert wrong.exit_code == 2 and "verbose" in wrong.output
    wrong = CliRunner().invoke(app, [*command, "--log-format", "xml"])
    assert wrong.exit_code == 2 and "xml" in wrong.output


def test_log_settings_are_checked_before_a_worker_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from rollsafe.cli.app import app

    monkeypatch.setenv("ROLLSAFE_TELEMETRY__LOG_FORMAT", "xml")
    refused = CliRunner().invoke(app, ["worker", "--run", "r"])
    assert refused.exit_code == 2
    assert "telemetry.log_format" in refused.output and "ROLLSAFE_TELEMETRY__LOG_FORMAT" in (
        refused.output
    )


def test_a_hooks_option_without_a_value_is_a_usage_error() -> None:
    serve = ("env", "serve", "--hooks", "json:loads", "--port", "0")
    result = invoke(*serve, "--hooks-option", "ab", env={"ROLLSAFE_ENV_TOKEN": "t"})
    assert result.exit_code == 2 and "--hooks-option 'ab': expected KEY=VALUE" in result.output
