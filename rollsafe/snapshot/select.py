"""Verify snapshots and pick the newest one that verifies (docs/design.md section 6, "select").

Everything here only reads: a damaged snapshot is reported and skipped, never repaired,
moved or deleted, so an operator can still inspect what went wrong. Restore fails closed:
when no candidate verifies, :class:`NoValidSnapshot` names every candidate with its reason.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from rollsafe.errors import (
    ContentMismatch,
    InvalidInput,
    NoValidSnapshot,
    SchemaMismatch,
    SnapshotCorrupt,
)
from rollsafe.snapshot._fs import (
    LATEST_NAME,
    SNAPSHOTS_DIR,
    TEMP_PREFIX,
    TRASH_PREFIX,
    hash_file,
    locked_dir,
    parse_dir_name,
    scan_tree,
)
from rollsafe.snapshot.bounded import read_regular
from rollsafe.snapshot.manifest import (
    LATEST_MAX_BYTES,
    MANIFEST_MAX_BYTES,
    MANIFEST_NAME,
    LatestPointer,
    SnapshotKind,
    SnapshotManifest,
    parse_latest,
    parse_manifest,
    validate_relpath,
    validation_failure,
)

_M = TypeVar("_M", bound=BaseModel)
Accept = Callable[[SnapshotManifest], str | None]
_Refused = (SnapshotCorrupt, SchemaMismatch)


class EntryState(StrEnum):
    VALID = "valid"  # published and verified
    INVALID = "invalid"  # published name, failed verification (see reason)
    UNCHECKED = "unchecked"  # published name, not verified (list(verify=False))
    TEMP = "temp"  # an unpublished draft, live or left by a crash
    TRASH = "trash"  # being deleted by retention or a sweep
    UNKNOWN = "unknown"  # not something the store writes


@dataclass(frozen=True)
class SnapshotEntry:
    name: str
    path: Path
    state: EntryState
    seq: int | None = None
    kind: SnapshotKind | None = None
    reason: str | None = None
    manifest: SnapshotManifest | None = None


@dataclass(frozen=True)
class SnapshotReader:
    """A verified snapshot. Reads re-check each file's digest: the disk may change after
    selection, and a restore must never load bytes that were not the published ones."""

    path: Path
    manifest: SnapshotManifest
    manifest_sha256: str
    skipped: Mapping[str, str] = field(default_factory=dict)
    latest_problem: str | None = None
    # Files whose bytes no read has checked yet (``select(contents=False)``): each read checks
    # and removes its file; :meth:`verify_unread` checks the rest. Empty: all were checked.
    unverified: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.path.name

    def read_bytes(self, relpath: str) -> bytes:
        validate_relpath(relpath)
        entry = self.manifest.files.get(relpath)
        if entry is None:
            raise InvalidInput(f"{relpath!r} is not a file of snapshot {self.name}")
        source = f"{self.name}/{relpath}"
        try:
            data = read_regular(self.path / relpath, limit=entry.bytes)
        except OSError as exc:
            raise ContentMismatch(f"{source}: unreadable ({exc})") from None
        if len(data) != entry.bytes:
            raise ContentMismatch(f"{source}: {len(data)} bytes, manifest says {entry.bytes}")
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ContentMismatch(f"{source}: sha256 does not match the manifest")
        self.unverified.discard(relpath)
        return data

    def checked_elsewhere(self, digests: Mapping[str, str]) -> None:
        """Files whose bytes another reader loaded after checking them against these sha256s
        (the data plane's import checks its own files): no second hash, once the digests are
        the manifest's."""
        for relpath, sha256 in digests.items():
            entry = self.manifest.files.get(relpath)
            if entry is None or entry.sha256 != sha256:
                raise ContentMismatch(f"{self.name}/{relpath}: not the file the manifest lists")
            self.unverified.discard(relpath)

    def verify_unread(self) -> None:
        """Hash the files no read has checked, so that the whole snapshot verified before
        anything outside this process (an environment) is told to restore from it."""
        for relpath in sorted(self.unverified):
            try:
                digest = hash_file(self.path / relpath).sha256
            except OSError as exc:
                raise ContentMismatch(f"{self.name}/{relpath}: unreadable ({exc})") from None
            if digest != self.manifest.files[relpath].sha256:
                raise ContentMismatch(f"{self.name}/{relpath}: sha256 does not match the manifest")
            self.unverified.discard(relpath)

    def read_json(self, relpath: str, model: type[_M]) -> _M:
        data = self.read_bytes(relpath)
        try:
            return model.model_validate_json(data)
        except ValidationError as exc:
            raise validation_failure(exc, f"{self.name}/{relpath}") from None


def verify_snapshot(path: Path, run_id: str) -> tuple[SnapshotManifest, str]:
    """Fully verify one published snapshot directory; return its manifest and the manifest's
    sha256. Raises SnapshotCorrupt or SchemaMismatch naming the directory and the problem."""
    try:
        return _verify(path, run_id)
    except _Refused as exc:
        raise type(exc)(f"{path}: {exc}") from None


def _verify(path: Path, run_id: str, *, contents: bool = True) -> tuple[SnapshotManifest, str]:
    parsed = parse_dir_name(path.name)
    if parsed is None:
        raise SnapshotCorrupt("not a snapshot directory name")
    if path.is_symlink() or not path.is_dir():
        raise SnapshotCorrupt("not a directory")
    manifest, digest = load_manifest(path, run_id)
    if (manifest.seq, manifest.kind) != parsed:
        raise SnapshotCorrupt(
            f"manifest says seq {manifest.seq} kind {manifest.kind.value}, "
            f"the directory name says seq {parsed[0]} kind {parsed[1].value}"
        )
    try:
        _verify_files(path, manifest, contents=contents)
    except OSError as exc:
        raise SnapshotCorrupt(f"unreadable ({exc})") from None
    return manifest, digest


def load_manifest(path: Path, run_id: str) -> tuple[SnapshotManifest, str]:
    """Parse ``path/manifest.json`` (errors name it relative to the snapshot)."""
    try:
        data = read_regular(path / MANIFEST_NAME, limit=MANIFEST_MAX_BYTES)
    except FileNotFoundError:
        raise SnapshotCorrupt(f"no {MANIFEST_NAME} (never published, or damaged)") from None
    except OSError as exc:
        raise SnapshotCorrupt(f"{MANIFEST_NAME} unreadable ({exc})") from None
    manifest = parse_manifest(data, MANIFEST_NAME, run_id)
    return manifest, hashlib.sha256(data).hexdigest()


def _verify_files(path: Path, manifest: SnapshotManifest, *, contents: bool = True) -> None:
    files, _dirs, oddities = scan_tree(path)
    if oddities:
        raise SnapshotCorrupt(f"symlink or special file(s) not allowed: {_few(oddities)}")
    present = set(files) - {MANIFEST_NAME}
    listed = set(manifest.files)
    problems = []
    if missing := sorted(listed - present):
        problems.append(f"missing file(s): {_few(missing)}")
    if extra := sorted(present - listed):
        problems.append(f"unlisted file(s): {_few(extra)}")
    # Sizes first: a truncated file is found by a stat, before any hashing.
    for relpath in sorted(listed & present):
        size = (path / relpath).lstat().st_size
        if size != manifest.files[relpath].bytes:
            problems.append(
                f"{relpath}: {size} bytes, manifest says {manifest.files[relpath].bytes}"
            )
    if problems:
        raise SnapshotCorrupt("; ".join(problems))
    for relpath in sorted(listed) if contents else ():
        if hash_file(path / relpath).sha256 != manifest.files[relpath].sha256:
            raise ContentMismatch(f"{relpath}: sha256 does not match the manifest")


def _few(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def classify(snapshots: Path) -> tuple[list[tuple[int, str]], dict[str, tuple[EntryState, str]]]:
    """Split the entries of ``snapshots/`` into published candidates ``(seq, name)``, newest
    first, and everything else with its state and why it is not a candidate."""
    candidates: list[tuple[int, str]] = []
    others: dict[str, tuple[EntryState, str]] = {}
    for child in snapshots.iterdir():
        name = child.name
        if name.startswith(TEMP_PREFIX):
            others[name] = (EntryState.TEMP, "unpublished draft (ignored; swept by begin)")
        elif name.startswith(TRASH_PREFIX):
            others[name] = (EntryState.TRASH, "being deleted (ignored)")
        elif (parsed := parse_dir_name(name)) is not None:
            candidates.append((parsed[0], name))
        else:
            others[name] = (EntryState.UNKNOWN, "not a snapshot directory name (ignored)")
    candidates.sort(reverse=True)
    return candidates, others


def accept_weight_versions(versions: Collection[int] | None) -> Accept | None:
    """Accepts a snapshot only at one of ``versions`` (those the trainer holds checkpoints
    of: a snapshot's rows and the trainer's weights must describe the same steps)."""
    if versions is None:
        return None
    held = frozenset(versions)

    def accept(manifest: SnapshotManifest) -> str | None:
        if manifest.weight_version in held:
            return None
        return f"no trainer checkpoint of its weight version {manifest.weight_version}"

    return accept


def accept_at_or_below(version: int | None) -> Accept | None:
    """Accepts a snapshot at or below weight version ``version`` (a restore that brings it
    forward by the journal and rolls back the steps past ``version``)."""
    if version is None:
        return None

    def accept(manifest: SnapshotManifest) -> str | None:
        if manifest.weight_version <= version:
            return None
        return f"its weight version {manifest.weight_version} is past the trainer's {version}"

    return accept


def select_snapshot(
    run_dir: Path,
    run_id: str,
    accept: Accept | None = None,
    *,
    contents: bool = True,
    refused: Mapping[str, str] | None = None,
) -> SnapshotReader:
    """The newest published snapshot that verifies and that ``accept`` (if given) accepts.

    ``contents=False``: the manifest, the file list and every size are checked, no byte is
    hashed; the reader checks each file as it is read (a restore loads every byte it hashes,
    once) and :meth:`SnapshotReader.verify_unread` the rest. A file that then fails is the
    caller's to report: it selects again with the snapshot in ``refused`` (name: why)."""
    snapshots = run_dir / SNAPSHOTS_DIR
    if not snapshots.is_dir():
        raise NoValidSnapshot(str(snapshots), _latest_reasons(run_dir, run_id, None, None))
    # A shared lock keeps retention (which runs under the exclusive lock) from deleting a
    # snapshot while it is being verified.
    with locked_dir(snapshots, exclusive=False):
        candidates, others = classify(snapshots)
        # Trash is retention's normal leftover until the next sweep: not worth reporting.
        reasons = {name: why for name, (state, why) in others.items() if state != EntryState.TRASH}
        for _seq, name in candidates:
            if refused is not None and name in refused:
                reasons[name] = refused[name]
                continue
            try:
                manifest, digest = _verify(snapshots / name, run_id, contents=contents)
            except _Refused as exc:
                reasons[name] = str(exc)
                continue
            if accept is not None and (why := accept(manifest)) is not None:
                reasons[name] = f"not accepted: {why}"
                continue
            problem = latest_problem(run_dir, run_id, name, digest)
            unverified = set() if contents else set(manifest.files)
            return SnapshotReader(snapshots / name, manifest, digest, reasons, problem, unverified)
        reasons.update(_latest_reasons(run_dir, run_id, None, None))
        raise NoValidSnapshot(str(snapshots), reasons)


def _latest_reasons(
    run_dir: Path, run_id: str, selected: str | None, digest: str | None
) -> dict[str, str]:
    problem = latest_problem(run_dir, run_id, selected, digest)
    return {} if problem is None else {LATEST_NAME: problem}


def read_latest(run_dir: Path) -> LatestPointer | None:
    """The parsed ``LATEST`` pointer, None when there is none; SnapshotCorrupt if unreadable."""
    try:
        data = read_regular(run_dir / LATEST_NAME, limit=LATEST_MAX_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SnapshotCorrupt(f"{LATEST_NAME} unreadable ({exc})") from None
    return parse_latest(data, LATEST_NAME)


def latest_problem(
    run_dir: Path, run_id: str, selected: str | None, digest: str | None
) -> str | None:
    """What is wrong with ``LATEST`` relative to the snapshot select chose, or None."""
    try:
        pointer = read_latest(run_dir)
    except _Refused as exc:
        return str(exc)
    if pointer is None:
        # Nothing valid and no pointer is one fact, already reported; a valid snapshot
        # without a pointer means a publish stopped before its LATEST update.
        return None if selected is None else f"{LATEST_NAME} is missing"
    if pointer.run_id != run_id:
        return f"{LATEST_NAME} belongs to run {pointer.run_id!r}, expected {run_id!r}"
    if parse_dir_name(pointer.snapshot) != (pointer.seq, pointer.kind):
        return f"{LATEST_NAME} names {pointer.snapshot!r}, inconsistent with its seq and kind"
    if not (run_dir / SNAPSHOTS_DIR / pointer.snapshot).is_dir():
        return f"{LATEST_NAME} names {pointer.snapshot}, which does not exist"
    if selected is None:
        return None  # it exists but did not verify: its own reason says why
    if pointer.snapshot != selected:
        return f"{LATEST_NAME} names {pointer.snapshot}, but {selected} was selected"
    if pointer.manifest_sha256 != digest:
        return f"{LATEST_NAME} records a different manifest sha256 for {selected}"
    return None


def list_entries(run_dir: Path, run_id: str, *, verify: bool = True) -> list[SnapshotEntry]:
    """Every entry of ``snapshots/``: candidates newest first, then the rest by name."""
    snapshots = run_dir / SNAPSHOTS_DIR
    if not snapshots.is_dir():
        return []
    with locked_dir(snapshots, exclusive=False):
        candidates, others = classify(snapshots)
        entries = [_candidate_entry(snapshots / name, run_id, verify) for _seq, name in candidates]
    entries.extend(
        SnapshotEntry(name, snapshots / name, state, reason=why)
        for name, (state, why) in sorted(others.items())
    )
    return entries


def _candidate_entry(path: Path, run_id: str, verify: bool) -> SnapshotEntry:
    parsed = parse_dir_name(path.name)
    assert parsed is not None  # classify only hands out parsed names
    seq, kind = parsed
    if not verify:
        return SnapshotEntry(path.name, path, EntryState.UNCHECKED, seq, kind)
    try:
        manifest, _digest = _verify(path, run_id)
    except _Refused as exc:
        return SnapshotEntry(path.name, path, EntryState.INVALID, seq, kind, str(exc))
    return SnapshotEntry(path.name, path, EntryState.VALID, seq, kind, manifest=manifest)
