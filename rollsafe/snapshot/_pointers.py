"""The remote store's small commit objects: one claim and one ``LATEST`` pointer per seq.

Both are conditional creates (:func:`rollsafe.snapshot._objects.create_exclusive`) under the
run's prefix, named by the seq::

    <run_id>/claims/<seq:08d>.json    who owns the seq: first, before any upload
    <run_id>/latest/<seq:08d>.json    LATEST: the newest one is the pointer

Neither can be replaced, so a claim never changes hands and ``LATEST`` never goes backwards.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from rollsafe.errors import InvalidInput, SchemaMismatch, SnapshotCorrupt
from rollsafe.snapshot import _fs
from rollsafe.snapshot import _objects as objects
from rollsafe.snapshot.manifest import (
    LatestPointer,
    SnapshotManifest,
    parse_latest,
    validation_failure,
)

CLAIMS_DIR: Final = "claims"
POINTERS_DIR: Final = "latest"


class SeqClaim(BaseModel):
    """``claims/<seq>.json``: the checkpoint that may publish this seq (one per seq)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    claim_version: Literal[1] = 1
    run_id: str
    seq: int
    checkpoint_id: str
    token: str  # tells this publisher's own claim apart from a concurrent one's


def seq_file(seq: int) -> str:
    return f"{seq:08d}.json"


def seq_of(name: str) -> int | None:
    """The seq a ``<seq:08d>.json`` name holds; None for any other name."""
    stem = name.removesuffix(".json")
    if name.endswith(".json") and len(stem) >= 8 and stem.isdigit() and stem.isascii():
        return int(stem)
    return None


def claim_seq(fs: Any, claims: str, run_id: str, manifest: SnapshotManifest) -> None:
    """Claim ``manifest.seq`` for its checkpoint under folder ``claims``. A claim of the same
    checkpoint (a retried publish) is fine; another checkpoint's is refused."""
    claim = SeqClaim(
        run_id=run_id, seq=manifest.seq, checkpoint_id=manifest.checkpoint_id, token=_fs.token()
    )
    path = f"{claims}/{seq_file(manifest.seq)}"
    if objects.create_exclusive(fs, path, claim.model_dump_json().encode()):
        return
    data = objects.read_object(fs, path)
    if data is None:
        raise objects.ObjectStoreUnavailable(f"{path}: claim vanished; publish again")
    try:
        held = SeqClaim.model_validate_json(data, strict=True)
    except ValidationError as exc:
        raise validation_failure(exc, path) from None
    if held.checkpoint_id != manifest.checkpoint_id:
        raise InvalidInput(
            f"seq {manifest.seq} is claimed by checkpoint {held.checkpoint_id!r}; refusing "
            f"to publish checkpoint {manifest.checkpoint_id!r} over it"
        )
    # The same checkpoint claimed it before (a retried publish): carry on, uploads are
    # idempotent and only one manifest can be created.


def newest_pointer(fs: Any, pointers: str) -> LatestPointer | None:
    """The newest pointer under folder ``pointers``; SnapshotCorrupt if it does not parse."""
    names = [n for n in objects.list_names(fs, pointers) if seq_of(n)]
    if not names:
        return None
    newest = max(names, key=lambda n: seq_of(n) or 0)
    data = objects.read_object(fs, f"{pointers}/{newest}")
    if data is None:
        return None  # deleted by retention meanwhile
    return parse_latest(data, f"{_fs.LATEST_NAME} ({POINTERS_DIR}/{newest})")


def create_pointer(
    fs: Any, pointers: str, run_id: str, name: str, manifest: SnapshotManifest, digest: str
) -> None:
    """This seq's pointer to snapshot ``name``; one that exists already (an earlier attempt
    of this publish) is left as it is."""
    pointer = LatestPointer(
        run_id=run_id,
        snapshot=name,
        seq=manifest.seq,
        kind=manifest.kind,
        checkpoint_id=manifest.checkpoint_id,
        manifest_sha256=digest,
    )
    path = f"{pointers}/{seq_file(manifest.seq)}"
    objects.create_exclusive(fs, path, pointer.model_dump_json(indent=2).encode())


def pointer_problem(
    fs: Any, pointers: str, run_id: str, selected: str | None, digest: str | None
) -> str | None:
    """What is wrong with ``LATEST`` relative to the snapshot select chose, or None."""
    try:
        pointer = newest_pointer(fs, pointers)
    except (SnapshotCorrupt, SchemaMismatch) as exc:
        return str(exc)
    if pointer is None:
        return None if selected is None else f"{_fs.LATEST_NAME} is missing"
    if pointer.run_id != run_id:
        return f"{_fs.LATEST_NAME} belongs to run {pointer.run_id!r}, expected {run_id!r}"
    if _fs.parse_dir_name(pointer.snapshot) != (pointer.seq, pointer.kind):
        return f"{_fs.LATEST_NAME} names {pointer.snapshot!r}, inconsistent with its seq"
    if selected is None:
        return None
    if pointer.snapshot != selected:
        return f"{_fs.LATEST_NAME} names {pointer.snapshot}, but {selected} was selected"
    if pointer.manifest_sha256 != digest:
        return f"{_fs.LATEST_NAME} records a different manifest sha256 for {selected}"
    return None
