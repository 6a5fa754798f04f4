"""The snapshot manifest (schema version 2) and the ``LATEST`` pointer (docs/snapshot-format.md).

A manifest is the last file written into a snapshot: it lists every other file with its sha256
and size, and carries its own ``digest``, the sha256 of the canonical JSON of every other field
(:func:`canonical_sha256`), so that no field that steers a restore (the journal position it
covers, the loader position, the counts) can change without the manifest being refused.
Parsing is strict so that a snapshot written by a newer rollsafe, or edited by hand, is refused
with a message that names what is unknown instead of being half-understood:

- ``schema_version`` is checked before anything else, so a version-3 manifest carrying new
  fields reports "unknown schema version 3" rather than a list of unknown fields;
- unknown fields, missing fields and values of the wrong JSON type are refused, by name;
- every listed path must be a plain relative POSIX path inside the snapshot;
- a digest that does not match the fields is refused (SnapshotCorrupt: damaged or edited).

Schema version 1 (an earlier rollsafe's) is still read: it has neither ``digest`` nor
``journal_id``, so its fields are trusted as they are, as they were.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Final, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails

from rollsafe.core.ids import RUN_ID_PATTERN
from rollsafe.errors import InvalidInput, SchemaMismatch, SnapshotCorrupt
from rollsafe.snapshot.bounded import parse_json

SCHEMA_VERSION: Final = 2
SCHEMA_VERSIONS: Final = (1, 2)  # read; 1 is an earlier rollsafe's
LATEST_VERSION: Final = 1
MANIFEST_NAME = "manifest.json"
# Larger files are refused unread: a manifest lists a snapshot's files (tens to thousands of
# lines), a LATEST pointer is a few hundred bytes.
MANIFEST_MAX_BYTES: Final = 64 << 20
LATEST_MAX_BYTES: Final = 64 << 10
_SHA256 = r"^[0-9a-f]{64}$"
JOURNAL_ID_PATTERN: Final = r"^[0-9a-f]{32}$"
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

    schema_version: Literal[1, 2] = SCHEMA_VERSION
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
    journal_id: str | None = Field(
        default=None,
        pattern=JOURNAL_ID_PATTERN,
        description="the run's journal (its segments carry the same id); None: journal off",
    )
    digest: str | None = Field(
        default=None,
        pattern=_SHA256,
        description="sha256 of every other field (schema 2: required on disk; sealed())",
    )

    @model_validator(mode="after")
    def _fields_of_its_version(self) -> SnapshotManifest:
        if self.schema_version == 1 and (self.journal_id, self.digest) != (None, None):
            raise ValueError("journal_id and digest are fields of schema_version 2, not 1")
        return self

    def sealed(self) -> SnapshotManifest:
        """This manifest at the current schema version, with the digest of its fields."""
        body = self.model_copy(update={"schema_version": SCHEMA_VERSION, "digest": None})
        sealed = with_digest(body.model_dump(mode="json"))
        return body.model_copy(update={"digest": sealed["digest"]})


def canonical_sha256(fields: Any) -> str:
    """sha256 of ``fields`` (JSON) as canonical JSON (sorted keys, no spaces): the same fields
    give the same digest whichever program wrote them and in which order."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def with_digest(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` (a JSON object) with ``digest``, the :func:`canonical_sha256` of the others,
    (re)computed: how a manifest and the journal's HEAD are sealed."""
    rest = {name: value for name, value in fields.items() if name != "digest"}
    return {**rest, "digest": canonical_sha256(rest)}


def digest_matches(raw: Mapping[str, Any]) -> bool:
    """Whether ``raw`` (a parsed JSON object) carries the digest of its other fields."""
    return bool(raw.get("digest") == with_digest(raw)["digest"])


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
    _check_version(raw, "schema_version", SCHEMA_VERSIONS, source)
    manifest = _validate(SnapshotManifest, data, source)
    if manifest.schema_version >= 2:
        if manifest.digest is None:
            raise SnapshotCorrupt(f"{source}: missing field 'digest'")
        if not digest_matches(raw):
            raise SnapshotCorrupt(
                f"{source}: its digest does not match its fields (edited or damaged)"
            )
    if run_id is not None and manifest.run_id != run_id:
        raise SnapshotCorrupt(
            f"{source}: belongs to run {manifest.run_id!r}, expected run {run_id!r}"
        )
    return manifest


def parse_latest(data: bytes, source: str) -> LatestPointer:
    raw = _json_object(data, source)
    _check_version(raw, "pointer_version", (LATEST_VERSION,), source)
    return _validate(LatestPointer, data, source)


def _json_object(data: bytes, source: str) -> dict[str, object]:
    try:
        raw = parse_json(data)
    except ValueError as exc:
        raise SnapshotCorrupt(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise SnapshotCorrupt(f"{source}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _check_version(
    raw: dict[str, object], field: str, supported: tuple[int, ...], source: str
) -> None:
    # Checked on the raw object, before the model: a newer writer's new fields would
    # otherwise be reported as "unknown fields" and hide the real cause.
    if field not in raw:
        raise SnapshotCorrupt(f"{source}: missing field {field!r}")
    version = raw[field]
    if type(version) is not int or version not in supported:
        readable = " and ".join(map(str, supported))
        raise SchemaMismatch(
            f"{source}: unknown {field} {version!r}; this rollsafe reads version {readable}"
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
