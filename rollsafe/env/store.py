"""A participant's records on disk: one JSON line per episode, a manifest that names and hashes
them. Pure file I/O; no pickle.

Layout under a commit's ``dest``::

    <dest>/<name>/records-<sha256>.jsonl   one canonical JSON object per line
    <dest>/<name>/manifest.json            ParticipantManifest (file is relative to dest)

The records file is renamed into place under its own digest, so a rename never replaces other
content. The manifest is created once (temp file + ``os.link``, which fails if the name exists):
of two racing writers exactly one wins, and the other learns the winner's checkpoint id.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollsafe.env.protocol import ParticipantKind, ParticipantManifest
from rollsafe.errors import OwnershipMismatch, SnapshotCorrupt
from rollsafe.snapshot._fs import fsync_dir, make_dirs_durable, token
from rollsafe.snapshot.bounded import parse_json, read_regular

MANIFEST = "manifest.json"
RECORDS_PREFIX = "records-"
_TEMP = ".tmp-"


def canonical(value: Any) -> bytes:
    """One canonical JSON line body: sorted keys, no spaces, no NaN (not JSON)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def records_file(name: str, sha256: str) -> str:
    """The records file's path relative to dest: the only spelling a reader accepts."""
    return f"{name}/{RECORDS_PREFIX}{sha256}.jsonl"


def write_records(
    dest_dir: Path | str,
    name: str,
    kind: ParticipantKind,
    instance: str,
    checkpoint_id: str,
    records: Iterable[dict[str, Any]],
    *,
    portable: bool = True,
) -> ParticipantManifest:
    """Write ``records`` and their manifest under ``<dest_dir>/<name>/``, durably.

    Idempotent per checkpoint: if the manifest already names ``checkpoint_id`` it is returned
    (and nothing is written); if it names another checkpoint, :class:`OwnershipMismatch`.
    """
    dest, folder = Path(dest_dir), Path(dest_dir) / name
    existing = _existing(folder, checkpoint_id)
    if existing is not None:
        return existing
    make_dirs_durable(folder)
    sha, count = _write_lines(folder, records)
    manifest = ParticipantManifest(
        name=name,
        kind=kind,
        instance=instance,
        checkpoint_id=checkpoint_id,
        file=records_file(name, sha),
        sha256=sha,
        records=count,
        portable=portable,
    )
    winner = _link_manifest(folder, manifest)
    if winner.file != manifest.file:  # we lost the race: our records file is nobody's
        (dest / manifest.file).unlink(missing_ok=True)
        fsync_dir(folder)
    return winner


def _write_lines(folder: Path, records: Iterable[dict[str, Any]]) -> tuple[str, int]:
    """Stream records to a temp file while hashing; rename it under its digest."""
    temp = folder / f"{_TEMP}{RECORDS_PREFIX}{token()}"
    digest, count = hashlib.sha256(), 0
    try:
        with open(temp, "xb") as handle:
            for record in records:
                if not isinstance(record, dict) or "episode" not in record:
                    raise ValueError(f"record {count} has no 'episode': every record names one")
                line = canonical(record) + b"\n"
                digest.update(line)
                handle.write(line)
                count += 1
            handle.flush()
            os.fsync(handle.fileno())
        sha = digest.hexdigest()
        # Same digest, same bytes: replacing an earlier identical file changes nothing.
        os.replace(temp, folder / f"{RECORDS_PREFIX}{sha}.jsonl")
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(folder)
    return sha, count


def _link_manifest(folder: Path, manifest: ParticipantManifest) -> ParticipantManifest:
    """Create manifest.json only if absent; the manifest that ends up there (ours or the
    winner's of the same checkpoint)."""
    temp = folder / f"{_TEMP}{MANIFEST}-{token()}"
    try:
        with open(temp, "xb") as handle:
            handle.write(canonical(manifest.model_dump(mode="json")) + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temp, folder / MANIFEST)
            won = True
        except FileExistsError:
            won = False
    finally:
        temp.unlink(missing_ok=True)
    fsync_dir(folder)
    if won:
        return manifest
    existing = _existing(folder, manifest.checkpoint_id)
    assert existing is not None  # the link failed because it exists
    return existing


def _existing(folder: Path, checkpoint_id: str) -> ParticipantManifest | None:
    path = folder / MANIFEST
    if not path.exists():
        return None
    manifest = _load_manifest(path)
    if manifest.checkpoint_id != checkpoint_id:
        raise OwnershipMismatch(
            f"{path} already holds checkpoint {manifest.checkpoint_id!r}; "
            f"refusing to write checkpoint {checkpoint_id!r} there"
        )
    return manifest


def _load_manifest(path: Path) -> ParticipantManifest:
    try:
        raw = read_regular(path)
    except OSError as exc:
        raise SnapshotCorrupt(f"{path}: cannot read the manifest ({exc.strerror or exc})") from None
    try:
        return ParticipantManifest.model_validate_json(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '<manifest>'}: {e['msg']}" for e in exc.errors()
        )
        raise SnapshotCorrupt(f"{path}: invalid manifest: {problems}") from None


def read_records(dest_dir: Path | str, name: str, checkpoint_id: str) -> list[dict[str, Any]]:
    """The records ``write_records`` wrote for ``checkpoint_id``, verified (manifest fields,
    checkpoint id, file digest, record count); :class:`SnapshotCorrupt` names what is wrong."""
    dest = Path(dest_dir)
    path = dest / name / MANIFEST
    manifest = _load_manifest(path)
    if manifest.name != name:
        raise SnapshotCorrupt(f"{path}: names participant {manifest.name!r}, not {name!r}")
    if manifest.checkpoint_id != checkpoint_id:
        raise SnapshotCorrupt(
            f"{path}: holds checkpoint {manifest.checkpoint_id!r}, not {checkpoint_id!r}"
        )
    if manifest.file != records_file(name, manifest.sha256):
        raise SnapshotCorrupt(f"{path}: records file {manifest.file!r} is not where it belongs")
    target = dest / manifest.file
    try:
        data = read_regular(target)
    except OSError as exc:
        raise SnapshotCorrupt(
            f"{target}: cannot read the records ({exc.strerror or exc})"
        ) from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != manifest.sha256:
        raise SnapshotCorrupt(f"{target}: sha256 {actual} differs from the manifest's")
    lines = data.splitlines()
    if len(lines) != manifest.records:
        raise SnapshotCorrupt(
            f"{target}: {len(lines)} records, the manifest says {manifest.records}"
        )
    return [_parse_line(target, number, line) for number, line in enumerate(lines, 1)]


def _parse_line(target: Path, number: int, line: bytes) -> dict[str, Any]:
    try:
        record = parse_json(line)
    except ValueError:
        raise SnapshotCorrupt(f"{target}: line {number} is not JSON") from None
    if not isinstance(record, dict) or "episode" not in record:
        raise SnapshotCorrupt(f"{target}: line {number} is not a record naming its episode")
    return record
