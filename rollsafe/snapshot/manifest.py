"""The snapshot manifest and the ``LATEST`` pointer, schema version 1 (docs/design.md section 10).

A manifest is the last file written into a snapshot and the only one trusted without a digest:
it lists every other file with its sha256 and size. Parsing is strict so that a snapshot
written by a newer rollsafe, or edited by hand, is refused with a message that names what is
unknown instead of being half-understood:

- ``schema_version`` is checked before anything else, so a version-2 manifest carrying new
  fields reports "unknown schema version 2" rather than a list of unknown fields;
- unknown fields, missing fields and values of the wrong JSON type are refused, by name;
- every listed path must be a plain relative POSIX path inside the snapshot.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Final, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    ValidationError,
)
from pydantic_core import ErrorDetails

from rollsafe.core.ids import RUN_ID_PATTERN
from rollsafe.errors import InvalidInput, SchemaMismatch, SnapshotCorrupt

SCHEMA_VERSION: Final = 1
LATEST_VERSION: Final = 1
MANIFEST_NAME = "manifest.json"
_SHA256 = r"^[0-9a-f]{64}$"
_M = TypeVar("_M", bound=BaseModel)


class SnapshotKind(StrEnum):
    ROLLOUT = "rollout"
    TRAINER = "trainer"


def relpath_problem(relpath: object) -> str | None:
    """Why ``relpath`` cannot name a file inside a snapshot, or None if it can.

    Only the canonical spelling is accepted (no ``.``, empty or ``..`` parts, no backslash) so
    that one file has exactly one key in the manifest and no key can reach outside the
    snapshot directory.
    """
    if not isinstance(relpath, str) or not relpath:
        return "must be a non-empty string"
    if "\\" in relpath or "\x00" in relpath:
        return "must be a POSIX path without backslashes or NUL"
    if relpath.startswith("/"):
        return "must be relative, not absolute"
    parts = relpath.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "must not contain empty, '.' or '..' parts"
    if relpath == MANIFEST_NAME:
        return f"{MANIFEST_NAME!r} is reserved for the manifest"
    return None


def validate_relpath(relpath: str) -> str:
    """Return ``relpath`` or raise :class:`InvalidInput` naming the problem."""
    problem = relpath_problem(relpath)
    if problem is not None:
        raise InvalidInput(f"invalid snapshot path {relpath!r}: {problem}")
    return relpath


def _check_relpath(relpath: str) -> str:
    problem = relpath_problem(relpath)
    if problem is not None:
        raise ValueError(f"invalid path {relpath!r}: {problem}")
    return relpath


RelPath = Annotated[str, AfterValidator(_check_relpath)]
RunId = Annotated[str, Field(pattern=RUN_ID_PATTERN.pattern, max_length=64)]
CheckpointId = Annotated[str, Field(min_length=1, max_length=512)]


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sha256: str = Field(pattern=_SHA256)
    bytes: NonNegativeInt


class SnapshotManifest(BaseModel):
    """Everything a restore needs to know about a snapshot before opening any other file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    run_id: RunId
    checkpoint_id: CheckpointId
    seq: NonNegativeInt
    kind: SnapshotKind
    anchor_step: NonNegativeInt | None = Field(
        default=None, description="trainer step the snapshot is anchored to, if any"
    )
    weight_version: NonNegativeInt
    loader_position: NonNegativeInt
    files: dict[RelPath, FileEntry] = Field(description="every file except manifest.json")
    counts: dict[str, int] = Field(default_factory=dict)
    created_at: float = Field(description="seconds since the epoch when publish began")


class LatestPointer(BaseModel):
    """Content of ``<root>/<run_id>/LATEST``: which snapshot was published last, and its digest.

    The pointer is a convenience for operators and a cross-check for restore; the newest
    snapshot that verifies wins even when the pointer is stale (a crash between the rename
    that publishes a snapshot and the pointer update leaves it one behind).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    pointer_version: Literal[1] = LATEST_VERSION
    run_id: RunId
    snapshot: str = Field(description="directory name under snapshots/, e.g. 00000007-rollout")
    seq: NonNegativeInt
    kind: SnapshotKind
    checkpoint_id: CheckpointId
    manifest_sha256: str = Field(pattern=_SHA256)


def parse_manifest(data: bytes, source: str, run_id: str | None = None) -> SnapshotManifest:
    """Parse manifest bytes; raise SchemaMismatch / SnapshotCorrupt naming ``source``."""
    raw = _json_object(data, source)
    _check_version(raw, "schema_version", SCHEMA_VERSION, source)
    manifest = _validate(SnapshotManifest, data, source)
    if run_id is not None and manifest.run_id != run_id:
        raise SnapshotCorrupt(
            f"{source}: belongs to run {manifest.run_id!r}, expected run {run_id!r}"
        )
    return manifest


def parse_latest(data: bytes, source: str) -> LatestPointer:
    raw = _json_object(data, source)
    _check_version(raw, "pointer_version", LATEST_VERSION, source)
    return _validate(LatestPointer, data, source)


def _json_object(data: bytes, source: str) -> dict[str, object]:
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotCorrupt(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise SnapshotCorrupt(f"{source}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _check_version(raw: dict[str, object], field: str, supported: int, source: str) -> None:
    # Checked on the raw object, before the model: a newer writer's new fields would
    # otherwise be reported as "unknown fields" and hide the real cause.
    if field not in raw:
        raise SnapshotCorrupt(f"{source}: missing field {field!r}")
    version = raw[field]
    if type(version) is not int or version != supported:
        raise SchemaMismatch(
            f"{source}: unknown {field} {version!r}; this rollsafe reads version {supported}"
        )


def _validate(model: type[_M], data: bytes, source: str) -> _M:
    try:
        # strict: JSON types must match exactly ("5" is not an int, 1 is not a bool).
        return model.model_validate_json(data, strict=True)
    except ValidationError as exc:
        raise validation_failure(exc, source) from None


def validation_failure(exc: ValidationError, source: str) -> SchemaMismatch | SnapshotCorrupt:
    """The error to raise for stored JSON that does not fit its model: unknown fields mean
    a different schema (SchemaMismatch), anything else means damage (SnapshotCorrupt)."""
    errors = exc.errors(include_url=False)
    message = f"{source}: {describe_errors(errors)}"
    if any(error["type"] == "extra_forbidden" for error in errors):
        return SchemaMismatch(message)
    return SnapshotCorrupt(message)


def describe_errors(errors: list[ErrorDetails]) -> str:
    """One line naming unknown fields, missing fields and bad values, in that order."""
    unknown = [_loc(e) for e in errors if e["type"] == "extra_forbidden"]
    missing = [_loc(e) for e in errors if e["type"] == "missing"]
    other = [
        f"{_loc(e)}: {e['msg']}" for e in errors if e["type"] not in ("extra_forbidden", "missing")
    ]
    parts = []
    if unknown:
        parts.append("unknown field(s): " + ", ".join(unknown))
    if missing:
        parts.append("missing field(s): " + ", ".join(missing))
    parts.extend(other)
    return "; ".join(parts)


def _loc(error: ErrorDetails) -> str:
    return ".".join(str(part) for part in error["loc"]) or "<root>"
