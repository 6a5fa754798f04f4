"""Manifest and LATEST parsing: strict, versioned, and naming what is wrong."""

from __future__ import annotations

import json

import pytest

from rollsafe.errors import InvalidInput, SchemaMismatch, SnapshotCorrupt
from rollsafe.snapshot import (
    SCHEMA_VERSION,
    FileEntry,
    LatestPointer,
    SnapshotKind,
    SnapshotManifest,
    parse_latest,
    parse_manifest,
    validate_relpath,
    with_digest,
)

SHA = "ab" * 32


def manifest_dict(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "schema_version": 1,
        "run_id": "run-1",
        "checkpoint_id": "ck-7",
        "seq": 7,
        "kind": "rollout",
        "anchor_step": None,
        "weight_version": 3,
        "loader_position": 128,
        "files": {"ledger.json": {"sha256": SHA, "bytes": 10}},
        "counts": {"groups": 4},
        "created_at": 1700000000.5,
    }
    base.update(overrides)
    return base


def encode(data: object) -> bytes:
    return json.dumps(data).encode()


def test_round_trip_through_json() -> None:
    manifest = parse_manifest(encode(manifest_dict()), "m", "run-1")
    assert manifest.kind is SnapshotKind.ROLLOUT
    assert manifest.files["ledger.json"] == FileEntry(sha256=SHA, bytes=10)
    again = parse_manifest(manifest.model_dump_json().encode(), "m", "run-1")
    assert again == manifest


def test_defaults_are_defined_once_on_the_model() -> None:
    manifest = SnapshotManifest(
        run_id="r",
        checkpoint_id="c",
        seq=1,
        kind=SnapshotKind.TRAINER,
        weight_version=0,
        loader_position=0,
        files={},
        created_at=0.0,
    )
    assert manifest.schema_version == SCHEMA_VERSION == 2
    assert manifest.digest is None and manifest.journal_id is None  # sealed() gives the digest
    assert manifest.anchor_step is None
    assert manifest.counts == {}


def test_snapshot_kind_is_a_str_enum() -> None:
    assert SnapshotKind("trainer") is SnapshotKind.TRAINER
    assert f"{SnapshotKind.ROLLOUT}" == "rollout"


def test_unknown_top_level_field_is_named() -> None:
    data = encode(manifest_dict(surprise=1, other="x"))
    with pytest.raises(
        SchemaMismatch, match=r"unknown field\(s\): (other, surprise|surprise, other)"
    ):
        parse_manifest(data, "snap/manifest.json")


def test_unknown_nested_field_is_named_with_its_path() -> None:
    files = {"ledger.json": {"sha256": SHA, "bytes": 10, "mode": 420}}
    with pytest.raises(SchemaMismatch, match=r"files\.ledger\.json\.mode"):
        parse_manifest(encode(manifest_dict(files=files)), "m")


def test_newer_schema_version_reports_the_version_not_its_new_fields() -> None:
    data = encode(manifest_dict(schema_version=3, shards={"a": 1}))
    with pytest.raises(SchemaMismatch, match="unknown schema_version 3") as info:
        parse_manifest(data, "m")
    assert "shards" not in str(info.value)


@pytest.mark.parametrize("version", [0, "1", 1.0, True, None])
def test_schema_version_must_be_exactly_the_integer_1(version: object) -> None:
    with pytest.raises(SchemaMismatch, match="unknown schema_version"):
        parse_manifest(encode(manifest_dict(schema_version=version)), "m")


def test_missing_schema_version_is_corrupt() -> None:
    data = manifest_dict()
    del data["schema_version"]
    with pytest.raises(SnapshotCorrupt, match="missing field 'schema_version'"):
        parse_manifest(encode(data), "m")


def test_missing_fields_are_named() -> None:
    data = manifest_dict()
    del data["files"]
    del data["seq"]
    with pytest.raises(SnapshotCorrupt, match=r"missing field\(s\): (seq, files|files, seq)"):
        parse_manifest(encode(data), "m")


@pytest.mark.parametrize(
    ("field", "value"),
    [("seq", "7"), ("seq", -1), ("weight_version", True), ("kind", "checkpoint"), ("counts", [])],
)
def test_wrong_json_types_and_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(SnapshotCorrupt, match=field):
        parse_manifest(encode(manifest_dict(**{field: value})), "m")


def test_wrong_run_id_is_refused() -> None:
    with pytest.raises(SnapshotCorrupt, match="belongs to run 'run-1', expected run 'other'"):
        parse_manifest(encode(manifest_dict()), "m", "other")


@pytest.mark.parametrize("data", [b"", b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_unparseable_manifest_is_corrupt(data: bytes) -> None:
    with pytest.raises(SnapshotCorrupt, match=r"snap/manifest\.json"):
        parse_manifest(data, "snap/manifest.json")


@pytest.mark.parametrize(
    "relpath", ["../escape", "/abs", "a/../b", "a//b", "./a", "a/.", "a\\b", "", "manifest.json"]
)
def test_manifest_file_keys_must_be_safe_relpaths(relpath: str) -> None:
    files = {relpath: {"sha256": SHA, "bytes": 1}}
    with pytest.raises(SnapshotCorrupt, match="invalid path"):
        parse_manifest(encode(manifest_dict(files=files)), "m")


def test_bad_digest_is_refused() -> None:
    files = {"a": {"sha256": "AB" * 32, "bytes": 1}}
    with pytest.raises(SnapshotCorrupt, match=r"files\.a\.sha256"):
        parse_manifest(encode(manifest_dict(files=files)), "m")


@pytest.mark.parametrize(
    "relpath", ["a", "dir/sub/file.bin", "envs/inst-0/x.json", "d/manifest.json"]
)
def test_validate_relpath_accepts_plain_relative_paths(relpath: str) -> None:
    assert validate_relpath(relpath) == relpath


@pytest.mark.parametrize(
    "relpath",
    ["..", "../x", "/etc/passwd", "a/../../b", "a/", "a\\b", "a\x00", "manifest.json", ""],
)
def test_validate_relpath_refuses_with_invalid_input(relpath: str) -> None:
    with pytest.raises(InvalidInput):
        validate_relpath(relpath)


def latest_dict(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "pointer_version": 1,
        "run_id": "run-1",
        "snapshot": "00000007-rollout",
        "seq": 7,
        "kind": "rollout",
        "checkpoint_id": "ck-7",
        "manifest_sha256": SHA,
    }
    base.update(overrides)
    return base


def test_latest_pointer_round_trip() -> None:
    pointer = parse_latest(encode(latest_dict()), "LATEST")
    assert pointer == LatestPointer.model_validate(latest_dict())


def test_latest_pointer_refuses_unknown_version_and_fields() -> None:
    with pytest.raises(SchemaMismatch, match="unknown pointer_version 9"):
        parse_latest(encode(latest_dict(pointer_version=9, extra=1)), "LATEST")
    with pytest.raises(SchemaMismatch, match="extra"):
        parse_latest(encode(latest_dict(extra=1)), "LATEST")
    with pytest.raises(SnapshotCorrupt, match="not valid JSON"):
        parse_latest(b"00000007-rollout", "LATEST")


def sealed_dict(**overrides: object) -> dict[str, object]:
    """A schema 2 manifest's fields, digest included, as publish writes them."""
    return with_digest(manifest_dict(schema_version=2, journal_id="0f" * 16, **overrides))


def test_a_sealed_manifest_round_trips_and_its_digest_covers_every_field() -> None:
    unsealed = parse_manifest(encode(manifest_dict()), "m")
    sealed = unsealed.sealed()
    assert sealed.schema_version == 2 and sealed.digest is not None
    again = parse_manifest(sealed.model_dump_json(indent=2).encode(), "m", "run-1")
    assert again == sealed
    # Key order and spacing do not matter: the digest is over canonical JSON.
    reordered = dict(reversed(list(sealed_dict().items())))
    assert parse_manifest(encode(reordered), "m").digest == sealed_dict()["digest"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("loader_position", 0),
        ("counts", {"groups": 4, "journal_position": 1}),
        ("journal_id", "1f" * 16),
        ("files", {"ledger.json": {"sha256": SHA, "bytes": 11}}),
    ],
)
def test_a_field_edited_without_its_digest_is_refused(field: str, value: object) -> None:
    data = {**sealed_dict(), field: value}
    with pytest.raises(SnapshotCorrupt, match="its digest does not match its fields"):
        parse_manifest(encode(data), "m")


def test_schema_2_needs_its_digest_and_schema_1_has_none() -> None:
    data = sealed_dict()
    del data["digest"]
    with pytest.raises(SnapshotCorrupt, match="missing field 'digest'"):
        parse_manifest(encode(data), "m")
    with pytest.raises(SnapshotCorrupt, match="fields of schema_version 2, not 1"):
        parse_manifest(encode(manifest_dict(digest=SHA)), "m")
