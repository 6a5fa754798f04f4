"""`rollsafe doctor` without a Temporal server: fix texts, skew arithmetic, the Ray and storage
checks, and the command against addresses nothing answers on (failing fast, named)."""

from __future__ import annotations

import json
import os
import pwd
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.common import SearchAttributeKey
from typer.testing import CliRunner

from rollsafe.cli.app import app
from rollsafe.cli.checktable import print_check_table
from rollsafe.cli.doctor import DoctorReport
from rollsafe.cli.doctor import checks as doctor_checks
from rollsafe.cli.doctor.checks import (
    DoctorCheck,
    Status,
    check_ray,
    check_storage,
    parse_ray_address,
    storage_fix,
)
from rollsafe.cli.doctor.temporal import (
    ClockSkew,
    attribute_findings,
    cli_type_name,
    create_attribute_command,
    describe_skew,
    measure_skew,
    namespace_create_command,
    skew_too_large,
)
from rollsafe.errors import InvalidInput
from rollsafe.snapshot import _fs
from rollsafe.snapshot import _objects as objects
from rollsafe.temporal.search_attributes import ALL

KEYWORD = IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
TEXT = IndexedValueType.INDEXED_VALUE_TYPE_TEXT
AS_ROOT = os.geteuid() == 0


def doctor(*args: str, address: str) -> tuple[int, str, float]:
    env = {
        "TEMPORAL_ADDRESS": address,
        "TEMPORAL_NAMESPACE": "default",
        "TEMPORAL_CONFIG_FILE": "/nonexistent/temporal.toml",  # no user profile leaks in
        "TEMPORAL_PROFILE": None,
        "RAY_ADDRESS": None,
        "ROLLSAFE_SNAPSHOT_ROOT": None,
    }
    started = time.monotonic()
    result = CliRunner().invoke(app, ["doctor", *args], env=env)
    return result.exit_code, result.output, time.monotonic() - started


def rows(output: str) -> dict[str, DoctorCheck]:
    report = DoctorReport.model_validate_json(output)
    return {check.name: check for check in report.checks}


# -- fix texts -------------------------------------------------------------------------------


def test_a_missing_attribute_is_named_with_its_create_command() -> None:
    registered = {"RollsafeRunId": KEYWORD, "RollsafePhase": KEYWORD}
    problems, fixes = attribute_findings(registered, ALL, "default")
    assert problems == ["RollsafeKind (Keyword) is not registered"]
    assert fixes == ["temporal operator search-attribute create --name RollsafeKind --type Keyword"]


def test_a_wrongly_typed_attribute_is_removed_then_created() -> None:
    registered = {"RollsafeRunId": KEYWORD, "RollsafePhase": TEXT, "RollsafeKind": KEYWORD}
    problems, fixes = attribute_findings(registered, ALL, "rl")
    assert problems == ["RollsafePhase is registered as Text, rollsafe needs Keyword"]
    assert fixes == [
        "temporal operator search-attribute remove --namespace rl --name RollsafePhase",
        "temporal operator search-attribute create --namespace rl --name RollsafePhase "
        "--type Keyword",
    ]


def test_registered_attributes_give_no_finding() -> None:
    registered = {key.name: key.indexed_value_type for key in ALL} | {"Other": TEXT}
    assert attribute_findings(registered, ALL, "default") == ([], [])


def test_every_type_has_the_cli_spelling() -> None:
    keys: list[SearchAttributeKey[Any]] = [
        SearchAttributeKey.for_text("a"),
        SearchAttributeKey.for_keyword("b"),
        SearchAttributeKey.for_int("c"),
        SearchAttributeKey.for_float("d"),
        SearchAttributeKey.for_bool("e"),
        SearchAttributeKey.for_datetime("f"),
        SearchAttributeKey.for_keyword_list("g"),
    ]
    names = [cli_type_name(key.indexed_value_type) for key in keys]
    assert names == ["Text", "Keyword", "Int", "Double", "Bool", "Datetime", "KeywordList"]
    assert create_attribute_command("X", "Int", "default").endswith("--name X --type Int")


def test_namespace_commands_quote_what_the_shell_would_split() -> None:
    assert namespace_create_command("rl") == "temporal operator namespace create --namespace rl"
    assert namespace_create_command("my ns").endswith("--namespace 'my ns'")


# -- clock skew arithmetic -------------------------------------------------------------------


def test_skew_is_measured_against_the_round_trips_midpoint() -> None:
    skew = measure_skew(server_s=1000.9, sent_s=1000.0, received_s=1000.2)
    assert skew.offset_s == pytest.approx(0.8)
    assert skew.uncertainty_s == pytest.approx(0.1)
    behind = measure_skew(server_s=997.1, sent_s=1000.0, received_s=1000.2)
    assert behind.offset_s == pytest.approx(-3.0)
    assert describe_skew(behind) == "server clock 3.000 s behind this machine's (± 0.100 s)"
    assert describe_skew(skew).startswith("server clock 0.800 s ahead of")


def test_a_reply_before_its_request_is_refused() -> None:
    with pytest.raises(ValueError, match="before sent"):
        measure_skew(server_s=5.0, sent_s=2.0, received_s=1.0)


@pytest.mark.parametrize(
    ("offset", "uncertainty", "too_large"),
    [
        (1.9, 0.0, False),
        (2.1, 0.0, True),
        (-2.1, 0.0, True),  # behind counts as much as ahead
        (2.5, 0.6, False),  # could be 1.9 s: a slow round trip is not a skew
        (2.5, 0.4, True),  # at least 2.1 s wherever the server stamped
    ],
)
def test_skew_fails_only_beyond_the_limit_wherever_the_server_stamped(
    offset: float, uncertainty: float, too_large: bool
) -> None:
    skew = ClockSkew(offset_s=offset, uncertainty_s=uncertainty)
    assert skew_too_large(skew, 2.0) is too_large


# -- Ray -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "parsed"),
    [
        ("head:6379", ("gcs", "head", 6379)),
        ("ray://head:10001", ("ray", "head", 10001)),
        ("[::1]:6379", ("gcs", "::1", 6379)),
    ],
)
def test_ray_addresses_parse(address: str, parsed: tuple[str, str, int]) -> None:
    assert parse_ray_address(address) == parsed


@pytest.mark.parametrize("address", ["head", "head:port", "http://head:8265", "head:0"])
def test_bad_ray_addresses_are_named(address: str) -> None:
    with pytest.raises(InvalidInput, match="Ray address"):
        parse_ray_address(address)


def test_ray_without_an_address_is_skipped() -> None:
    assert check_ray(None, 1.0).status is Status.SKIPPED


def test_auto_without_a_local_cluster_fails_and_local_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(doctor_checks, "_local_ray_clusters", lambda: (None, []))
    auto = check_ray("auto", 1.0)
    assert auto.status is Status.FAILED and "no Ray cluster on this machine" in auto.detail
    assert check_ray("local", 1.0).status is Status.SKIPPED


def test_an_unreachable_ray_is_named(dead_port: int) -> None:
    check = check_ray(f"127.0.0.1:{dead_port}", 1.0)
    assert check.status is Status.FAILED
    assert check.detail == f"cannot reach Ray at 127.0.0.1:{dead_port}: Connection refused"
    assert "RAY_ADDRESS" in check.fix


def test_a_ray_client_port_that_accepts_is_ok(silent_port: int) -> None:
    check = check_ray(f"ray://127.0.0.1:{silent_port}", 1.0)
    assert check.status is Status.OK and str(silent_port) in check.detail


def test_without_the_node_count_a_gcs_that_accepts_is_ok_at_once(
    silent_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `rollsafe worker` checks before ray.init: the connect, and no GCS client."""

    def refuse(*args: Any) -> str:
        raise AssertionError("asked the GCS")

    monkeypatch.setattr(doctor_checks, "_node_count", refuse)
    check = check_ray(f"127.0.0.1:{silent_port}", 1.0, count_nodes=False)
    assert check.status is Status.OK
    assert check.detail == f"GCS at 127.0.0.1:{silent_port} accepts connections"


# -- snapshot storage ------------------------------------------------------------------------


def test_storage_probe_passes_and_leaves_nothing_behind(tmp_path: Path) -> None:
    (tmp_path / "existing").mkdir()
    check = check_storage(tmp_path / "existing")
    assert check.status is Status.OK, check
    assert "GiB free" in check.detail and "rename" in check.detail
    assert list((tmp_path / "existing").iterdir()) == []
    missing = check_storage(tmp_path / "new" / "root")
    assert missing.status is Status.OK and "created and removed again" in missing.detail
    assert [p.name for p in tmp_path.iterdir()] == ["existing"]


def test_a_root_under_a_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    root = tmp_path / "file" / "sub"
    check = check_storage(root)
    assert check.status is Status.FAILED
    assert check.detail == f"{root}: Not a directory"
    assert "is a file, not a directory" in check.fix and str(root) in check.fix


def test_a_read_only_root_is_named_with_the_permission_fix() -> None:
    # Root writes through directory permissions (and CI runs as root): there the check runs
    # in a child that drops to nobody, in a directory nobody may enter but not write.
    with tempfile.TemporaryDirectory() as parent:
        os.chmod(parent, 0o755)
        locked = Path(parent) / "locked"
        locked.mkdir(mode=0o555)
        check = _check_storage_as_nobody(locked) if AS_ROOT else check_storage(locked)
    assert check.status is Status.FAILED and "Permission denied" in check.detail
    assert f"write access to {locked}" in check.fix


def _check_storage_as_nobody(root: Path) -> DoctorCheck:
    """check_storage in a forked child that has dropped to nobody (not exec'd: the
    interpreter may live where nobody cannot read, as pyenv's under /root does)."""
    nobody = pwd.getpwnam("nobody")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            os.write(write, check_storage(root).model_dump_json().encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        reply = answer.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the check failed in the child"
    return DoctorCheck.model_validate_json(reply)


def test_a_filesystem_whose_flock_does_not_exclude_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_fs, "try_lock", lambda fd: True)
    check = check_storage(tmp_path)
    assert check.status is Status.FAILED and "flock" in check.detail


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (13, "write access to"),  # EACCES
        (30, "read-only filesystem"),  # EROFS
        (28, "is full"),  # ENOSPC
        (5, "permissions, mount"),  # EIO: anything else
    ],
)
def test_storage_fixes_follow_the_error(code: int, words: str) -> None:
    assert words in storage_fix(Path("/snap"), OSError(code, os.strerror(code)))


def test_storage_without_a_root_is_skipped() -> None:
    assert check_storage(None).status is Status.SKIPPED


@pytest.fixture
def bucket() -> Iterator[str]:
    """A fresh memory:// bucket (object storage in this process), removed afterwards."""
    fsspec = pytest.importorskip("fsspec")
    name = f"doctor-{uuid.uuid4().hex[:12]}"
    yield f"memory://{name}/snapshots"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def test_object_storage_probe_passes_and_leaves_nothing_behind(bucket: str) -> None:
    check = check_storage(bucket)
    assert check.status is Status.OK, check
    assert "second create refused" in check.detail and ".rollsafe-doctor" in check.detail
    fs, base = objects.open_filesystem(bucket)
    assert fs.find(base) == []


def test_a_store_that_ignores_conditional_creates_is_named(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An S3-compatible server that ignores If-None-Match: every create overwrites."""
    fs, base = objects.open_filesystem(bucket)
    real_pipe = fs.pipe_file

    def overwriting(path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        real_pipe(path, value, **kwargs)

    monkeypatch.setattr(fs, "pipe_file", overwriting)
    check = check_storage(bucket)
    assert check.status is Status.FAILED
    assert "conditional create (If-None-Match: *) of an existing object was accepted" in (
        check.detail
    )
    assert "412" in check.fix
    assert fs.find(base) == []


def test_an_unsupported_storage_url_is_named() -> None:
    check = check_storage("ftp://host/snapshots")
    assert check.status is Status.FAILED
    assert "unsupported snapshot storage scheme 'ftp'" in check.detail
    assert "s3://bucket/prefix" in check.fix


def test_a_hung_object_store_fails_within_the_timeout(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs, _base = objects.open_filesystem(bucket)
    release = threading.Event()
    monkeypatch.setattr(fs, "pipe_file", lambda *args, **kwargs: release.wait(30))
    started = time.monotonic()
    try:
        check = check_storage(bucket, timeout_s=0.3)
    finally:
        release.set()
    assert time.monotonic() - started < 5
    assert check.status is Status.FAILED and "no answer from the object store" in check.detail
    assert "AWS_ENDPOINT_URL" in check.fix


# -- the command -----------------------------------------------------------------------------


def test_an_unreachable_temporal_fails_fast_and_is_named(dead_port: int, tmp_path: Path) -> None:
    code, output, seconds = doctor(
        "--json", "--snapshot-root", str(tmp_path), address=f"127.0.0.1:{dead_port}"
    )
    assert code == 1, output
    assert seconds < 3.0
    found = rows(output)
    reach = found["Temporal reachable"]
    assert reach.status is Status.FAILED
    assert f"cannot reach Temporal server at 127.0.0.1:{dead_port}" in reach.detail
    assert "Connection refused" in reach.detail and "TEMPORAL_ADDRESS" in reach.fix
    assert [found[n].status for n in ("namespace exists", "search attributes", "clock skew")] == [
        Status.SKIPPED
    ] * 3
    assert found["snapshot storage"].status is Status.OK  # the other checks still ran


def test_a_temporal_that_never_answers_fails_within_the_timeout(silent_port: int) -> None:
    code, output, seconds = doctor("--json", "--timeout-s", "1", address=f"127.0.0.1:{silent_port}")
    assert code == 1 and seconds < 4.0, (seconds, output)
    assert "did not answer within 1 s" in rows(output)["Temporal reachable"].detail


def test_an_unwritable_snapshot_root_fails_the_command(dead_port: int, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    root = tmp_path / "file" / "sub"
    code, output, _ = doctor("--snapshot-root", str(root), address=f"127.0.0.1:{dead_port}")
    assert code == 1
    assert "snapshot storage" in output and "Not a directory" in output
    assert "FAILED" in output and "fix" in output


def test_bad_temporal_settings_are_a_finding_not_a_crash() -> None:
    code, output, _ = doctor("--json", address="no-port-here")
    assert code == 1
    reach = rows(output)["Temporal reachable"]
    assert "is not host:port" in reach.detail and "TEMPORAL_ADDRESS=host:port" in reach.fix


def test_skipped_checks_do_not_fail_a_report() -> None:
    skipped = DoctorCheck(name="a", status=Status.SKIPPED, detail="")
    assert DoctorReport.of([skipped]).ok
    assert not DoctorReport.of([skipped, skipped.model_copy(update={"status": Status.FAILED})]).ok
    with pytest.raises(ValueError, match="extra"):
        DoctorCheck.model_validate({"name": "a", "status": "ok", "detail": "", "extra": 1})


def test_the_table_prints_brackets_literally(capsys: pytest.CaptureFixture[str]) -> None:
    print_check_table("t", [("n", "FAILED", "missing: [red]x[/red] ['RollsafeKind']")])
    assert "[red]x[/red] ['RollsafeKind']" in capsys.readouterr().out


def test_json_output_is_one_object(dead_port: int) -> None:
    code, output, _ = doctor("--json", address=f"127.0.0.1:{dead_port}")
    payload = json.loads(output)
    assert code == 1 and payload["ok"] is False and len(payload["checks"]) == 7
    assert payload["checks"][-1]["name"] == "environment instances"  # none configured: skipped
