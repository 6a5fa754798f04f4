"""A snapshot being written: a locked ``.tmp-*`` directory that becomes visible only at publish.

Every file is hashed exactly once, while it is written (:meth:`SnapshotDraft.open`) or, for
files another component wrote straight into the directory, when it is recorded
(:meth:`SnapshotDraft.record`). Publish refuses a draft holding any file it has not recorded,
so the manifest always lists everything a restore will find.
"""

from __future__ import annotations

import json
import os
import stat
import time
import weakref
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from pydantic import BaseModel, ValidationError

from rollsafe.errors import InvalidInput
from rollsafe.snapshot._fs import fsync_dir, hash_file, scan_tree
from rollsafe.snapshot.manifest import (
    MANIFEST_NAME,
    FileEntry,
    SnapshotKind,
    SnapshotManifest,
    describe_errors,
    validate_relpath,
)
from rollsafe.snapshot.tensorfile import HashingWriter

if TYPE_CHECKING:
    from rollsafe.snapshot.store import PublishedSnapshot, SnapshotStore


class _State(Enum):
    OPEN = "open"
    PUBLISHED = "published"
    DISCARDED = "discarded"


class SnapshotDraft:
    """Created by :meth:`SnapshotStore.begin`; use as a context manager to discard on error."""

    def __init__(
        self,
        store: SnapshotStore,
        path: Path,
        lock_fd: int,
        kind: SnapshotKind,
        checkpoint_id: str,
        seq: int,
    ) -> None:
        self.path = path
        self.kind = kind
        self.checkpoint_id = checkpoint_id
        self.seq = seq
        self._store = store
        self._files: dict[str, FileEntry] = {}
        self._state = _State.OPEN
        self._manifest_written = False
        # The flock on the directory marks this draft as alive; a draft dropped without
        # publish or discard releases it here, like a crashed process would.
        self._unlock = weakref.finalize(self, os.close, lock_fd)

    # -- writing ---------------------------------------------------------------------------

    @contextmanager
    def open(self, relpath: str) -> Iterator[HashingWriter]:
        """A new file at ``relpath``, hashed while written; fsynced and recorded on exit.
        If the block raises, the partial file is removed and nothing is recorded."""
        relpath = self._new_relpath(relpath)
        target = self.path / relpath
        try:
            handle = open(target, "xb")  # noqa: SIM115 - closed below, on every path
        except FileExistsError:
            raise InvalidInput(f"draft already has a file at {relpath!r}") from None
        try:
            with handle:
                writer = HashingWriter(handle)
                yield writer
                handle.flush()
                os.fsync(handle.fileno())
        except BaseException:
            target.unlink(missing_ok=True)
            raise
        self._files[relpath] = FileEntry(sha256=writer.hexdigest(), bytes=writer.size)

    def write_bytes(self, relpath: str, data: bytes) -> FileEntry:
        with self.open(relpath) as out:
            out.write(data)
        return self._files[relpath]

    def write_json(self, relpath: str, data: object) -> FileEntry:
        """Write a pydantic model, or anything ``json.dumps`` accepts (no NaN/Infinity)."""
        if isinstance(data, BaseModel):
            encoded = data.model_dump_json().encode()
        else:
            try:
                encoded = json.dumps(data, sort_keys=True, allow_nan=False).encode()
            except (TypeError, ValueError) as exc:
                raise InvalidInput(f"{relpath!r}: not JSON-serialisable ({exc})") from None
        return self.write_bytes(relpath, encoded)

    def record(self, relpath: str) -> list[str]:
        """Hash (and fsync) a file, or every file under a directory, that another component
        wrote into :attr:`path`. Files already recorded are not hashed again. Returns the
        relpaths newly recorded."""
        self._check_open()
        validate_relpath(relpath)
        target = self.path / relpath
        try:
            mode = target.lstat().st_mode
        except FileNotFoundError:
            raise InvalidInput(f"nothing to record at {relpath!r} in {self.path}") from None
        if stat.S_ISREG(mode):
            if relpath in self._files:
                raise InvalidInput(f"{relpath!r} is already recorded")
            names = [relpath]
        elif stat.S_ISDIR(mode):
            names = self._unrecorded_under(relpath, target)
        else:
            raise InvalidInput(f"{relpath!r} is not a regular file or directory")
        for name in names:
            self._files[name] = hash_file(self.path / name, sync=True)
        return names

    def record_hashed(self, entries: Mapping[str, FileEntry]) -> None:
        """Record files another component wrote, hashed and fsynced itself (a data-plane
        export): trusting its digests saves reading every byte a second time. Sizes are
        checked here and every digest again by ``select`` before anything is restored."""
        self._check_open()
        for relpath, entry in entries.items():
            validate_relpath(relpath)
            if relpath in self._files:
                raise InvalidInput(f"{relpath!r} is already recorded")
            target = self.path / relpath
            if not target.is_file() or target.lstat().st_size != entry.bytes:
                raise InvalidInput(f"{relpath!r}: missing, or not {entry.bytes} bytes")
            self._files[relpath] = entry

    def _unrecorded_under(self, relpath: str, directory: Path) -> list[str]:
        files, _dirs, oddities = scan_tree(directory)
        if oddities:
            shown = ", ".join(f"{relpath}/{odd}" for odd in oddities)
            raise InvalidInput(f"symlinks and special files cannot be recorded: {shown}")
        names = [validate_relpath(f"{relpath}/{name}") for name in files]
        return [name for name in names if name not in self._files]

    @property
    def files(self) -> Mapping[str, FileEntry]:
        return dict(self._files)

    # -- finishing -------------------------------------------------------------------------

    def publish(
        self,
        *,
        weight_version: int,
        loader_position: int,
        anchor_step: int | None = None,
        counts: Mapping[str, int] | None = None,
        anchors: Collection[int] = (),
        journal_id: str | None = None,
    ) -> PublishedSnapshot:
        """Write the manifest last and atomically make the snapshot visible (see
        :meth:`SnapshotStore.publish_draft` for the steps, the idempotent re-publish, and
        retention's ``anchors``). ``journal_id``: the run's journal, whose records up to
        ``counts["journal_position"]`` the snapshot covers."""
        self._check_open()
        self._check_complete()
        manifest = self._manifest(weight_version, loader_position, anchor_step, counts, journal_id)
        return self._store.publish_draft(self, manifest, anchors)

    def discard(self) -> None:
        """Delete the draft. A no-op once published or discarded, so ``finally: discard()``
        and the context manager are always safe."""
        if self._state is not _State.OPEN:
            return
        self._state = _State.DISCARDED
        try:
            self._store.remove_draft_dir(self.path)
        finally:  # unlocked even when the disk refused: a later sweep may then remove it
            self._unlock()

    def __enter__(self) -> SnapshotDraft:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.discard()

    # -- used by the store while it holds the publish lock ---------------------------------

    def write_manifest(self, manifest: SnapshotManifest) -> str:
        """Write and fsync ``manifest.json`` (and the directory); return its sha256."""
        with open(self.path / MANIFEST_NAME, "xb") as handle:
            self._manifest_written = True
            writer = HashingWriter(handle)
            writer.write(manifest.model_dump_json(indent=2).encode())
            handle.flush()
            os.fsync(handle.fileno())
        fsync_dir(self.path)
        return writer.hexdigest()

    def unwrite_manifest(self) -> None:
        """Undo :meth:`write_manifest` after a failure before the rename, so a retry of
        publish on this draft does not see an unrecorded ``manifest.json``."""
        if self._manifest_written:
            (self.path / MANIFEST_NAME).unlink(missing_ok=True)
            self._manifest_written = False

    def mark_published(self) -> None:
        self._state = _State.PUBLISHED
        self._unlock()

    # -- checks ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise InvalidInput(f"draft {self.path.name} is already {self._state.value}")

    def _new_relpath(self, relpath: str) -> str:
        self._check_open()
        validate_relpath(relpath)
        if relpath in self._files:
            raise InvalidInput(f"draft already has a file at {relpath!r}")
        try:
            (self.path / relpath).parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise InvalidInput(f"{relpath!r}: a parent of it is a file") from None
        return relpath

    def _check_complete(self) -> None:
        """Every file in the directory recorded, every recorded file still there with its
        size; then fsync every directory (files were fsynced when written or recorded)."""
        files, dirs, oddities = scan_tree(self.path)
        problems = []
        if oddities:
            problems.append("symlinks or special files: " + ", ".join(oddities))
        if unrecorded := sorted(set(files) - set(self._files)):
            problems.append(
                "unrecorded file(s) (write via the draft or record()): " + ", ".join(unrecorded)
            )
        for relpath, entry in sorted(self._files.items()):
            target = self.path / relpath
            if not target.is_file() or target.lstat().st_size != entry.bytes:
                problems.append(f"{relpath}: changed or removed after it was recorded")
        if problems:
            raise InvalidInput(f"cannot publish {self.path.name}: " + "; ".join(problems))
        # Deepest first, so each directory is synced after the entries made inside it.
        for relpath in sorted(dirs, key=lambda d: d.count("/"), reverse=True):
            fsync_dir(self.path / relpath)
        fsync_dir(self.path)

    def _manifest(
        self,
        weight_version: int,
        loader_position: int,
        anchor_step: int | None,
        counts: Mapping[str, int] | None,
        journal_id: str | None,
    ) -> SnapshotManifest:
        fields = {
            "run_id": self._store.run_id,
            "checkpoint_id": self.checkpoint_id,
            "seq": self.seq,
            "kind": self.kind,
            "anchor_step": anchor_step,
            "weight_version": weight_version,
            "loader_position": loader_position,
            "files": dict(sorted(self._files.items())),
            "counts": dict(counts or {}),
            "created_at": time.time(),
            "journal_id": journal_id,
        }
        try:
            return SnapshotManifest.model_validate(fields, strict=True).sealed()
        except ValidationError as exc:
            errors = describe_errors(exc.errors(include_url=False))
            raise InvalidInput(f"invalid snapshot metadata: {errors}") from None
