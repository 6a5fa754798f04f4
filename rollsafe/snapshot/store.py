"""The snapshot store of one run: drafts, atomic publish, the ``LATEST`` pointer, retention.

Layout (docs/design.md section 10)::

    <root>/<run_id>/snapshots/<seq:08d>-<kind>/   published, immutable, manifest.json last
    <root>/<run_id>/snapshots/.tmp-*              drafts (never candidates)
    <root>/<run_id>/snapshots/.trash-*            being deleted (never candidates)
    <root>/<run_id>/LATEST                        JSON pointer to the last published snapshot

The rename of a draft to its final name is the commit point: before it the snapshot is
invisible, after it the snapshot is complete (its manifest and every file were fsynced
first). Publish, ``LATEST`` and retention run under an exclusive ``flock`` on
``snapshots/``; select and list take it shared, so retention never deletes a snapshot
that is being verified.
"""

from __future__ import annotations

import builtins
import logging
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rollsafe.core.config import KEEP_LATEST_K
from rollsafe.core.ids import snapshot_dir_name, validate_run_id
from rollsafe.errors import InvalidInput, RollsafeError, SchemaMismatch, SnapshotCorrupt
from rollsafe.snapshot import _fs
from rollsafe.snapshot.draft import SnapshotDraft
from rollsafe.snapshot.manifest import LatestPointer, SnapshotKind, SnapshotManifest
from rollsafe.snapshot.retention import plan_retention
from rollsafe.snapshot.select import (
    Accept,
    EntryState,
    SnapshotEntry,
    SnapshotReader,
    list_entries,
    load_manifest,
    read_latest,
    select_snapshot,
    verify_snapshot,
)

FaultHook = Callable[[str], None]


class FolderMirror(Protocol):
    """A copy of a run's folder, file by file, where the snapshots are (object storage)."""

    def upload(self, path: Path) -> None: ...
    def names(self) -> builtins.list[str]: ...
    def fetch(self, name: str, directory: Path) -> None: ...
    def remove(self, names: builtins.list[str]) -> None: ...


log = logging.getLogger(__name__)
PUBLISHED_STATES = (EntryState.VALID, EntryState.INVALID, EntryState.UNCHECKED)
# Named points inside publish where a test can crash the process (docs/design.md section 12).
FAULT_POINTS = ("before_manifest", "before_rename", "before_latest", "before_retention")
_MAX_CHECKPOINT_ID = 512


@dataclass(frozen=True)
class PublishedSnapshot:
    path: Path
    manifest: SnapshotManifest
    manifest_sha256: str
    reused: bool  # True when an identical earlier publish (same seq and checkpoint) won

    @property
    def name(self) -> str:
        return self.path.name

    def reader(self) -> SnapshotReader:
        return SnapshotReader(self.path, self.manifest, self.manifest_sha256)


class SnapshotStore:
    def __init__(
        self,
        root: Path,
        run_id: str,
        keep_latest_k: int = KEEP_LATEST_K,
        *,
        fault_hook: FaultHook | None = None,
    ) -> None:
        if type(keep_latest_k) is not int or keep_latest_k < 1:
            raise InvalidInput(f"keep_latest_k must be an integer >= 1, got {keep_latest_k!r}")
        self.root = Path(root)
        self.run_id = validate_run_id(run_id)
        self.keep_latest_k = keep_latest_k
        self._fault = fault_hook

    @property
    def run_dir(self) -> Path:
        return self.root / self.run_id

    @property
    def snapshots_dir(self) -> Path:
        return self.run_dir / _fs.SNAPSHOTS_DIR

    @property
    def latest_path(self) -> Path:
        return self.run_dir / _fs.LATEST_NAME

    # -- reading ---------------------------------------------------------------------------

    def select(
        self,
        accept: Accept | None = None,
        *,
        contents: bool = True,
        refused: Mapping[str, str] | None = None,
    ) -> SnapshotReader:
        """Newest snapshot that fully verifies and that ``accept`` returns None for; raises
        NoValidSnapshot with one reason per refused candidate. Never changes the disk.
        ``contents=False``, ``refused``: see :func:`~rollsafe.snapshot.select.select_snapshot`
        (a restore hashes each byte once, as it loads it)."""
        reader = select_snapshot(
            self.run_dir, self.run_id, accept, contents=contents, refused=refused
        )
        return log_selected(self.run_id, reader)

    def list(self, *, verify: bool = True) -> list[SnapshotEntry]:
        return list_entries(self.run_dir, self.run_id, verify=verify)

    def has_published(self) -> bool:
        """Whether the run has published a snapshot (verified or not): a fresh controller of
        it awaits its restore."""
        return any(entry.state in PUBLISHED_STATES for entry in self.list(verify=False))

    def latest_pointer(self) -> LatestPointer | None:
        return read_latest(self.run_dir)

    def verify_published(self, seq: int) -> PublishedSnapshot | None:
        """The published snapshot with ``seq``, fully verified, as ``reused``: what an earlier
        attempt of a publish left. None when no snapshot with this seq is published (a draft
        is not); SnapshotCorrupt or SchemaMismatch when one is and does not verify."""
        if not self.snapshots_dir.is_dir():
            return None
        with _fs.locked_dir(self.snapshots_dir, exclusive=False):  # retention waits
            path = self._published_with_seq(seq)
            if path is None:
                return None
            manifest, digest = verify_snapshot(path, self.run_id)
        return PublishedSnapshot(path, manifest, digest, reused=True)

    # -- writing ---------------------------------------------------------------------------

    def begin(
        self,
        kind: SnapshotKind | str,
        checkpoint_id: str,
        seq: int | None = None,
        *,
        sweep: bool = True,
    ) -> SnapshotDraft:
        """Open a draft. Sweeps drafts left by crashed writers first (``sweep=False``: the
        caller did, e.g. before taking a lock it may not hold across the deletes);
        ``seq=None`` takes the next number after the highest published one."""
        kind = _kind(kind)
        _check_checkpoint_id(checkpoint_id)
        if seq is not None and (type(seq) is not int or seq < 0):
            raise InvalidInput(f"seq must be an integer >= 0, got {seq!r}")
        _fs.make_dirs_durable(self.snapshots_dir)
        if sweep:
            self.sweep()
        if seq is None:
            seq = max(self._published_seqs(), default=0) + 1
        path, fd = self._make_draft_dir(snapshot_dir_name(seq, kind))
        return SnapshotDraft(self, path, fd, kind, checkpoint_id, seq)

    def sweep(self) -> builtins.list[str]:
        """Remove trash and every draft directory whose writer is gone (its flock is free).
        A live draft, e.g. of a concurrent activity attempt, is left alone."""
        removed: builtins.list[str] = []
        if not self.snapshots_dir.is_dir():
            return removed
        for child in sorted(self.snapshots_dir.iterdir()):
            if child.name.startswith(_fs.TRASH_PREFIX):
                _fs.remove_tree(child)
                removed.append(child.name)
            elif child.name.startswith(_fs.TEMP_PREFIX) and self._sweep_draft(child):
                removed.append(child.name)
        return removed

    def _sweep_draft(self, path: Path) -> bool:
        try:
            fd = _fs.open_dir(path)
        except FileNotFoundError:
            return False  # published or discarded meanwhile
        try:
            if not _fs.try_lock(fd):
                return False
            self._to_trash([path])
        finally:
            os.close(fd)
        return True

    def _make_draft_dir(self, final_name: str) -> tuple[Path, int]:
        for _ in range(8):
            path = self.snapshots_dir / f"{_fs.TEMP_PREFIX}{final_name}-{_fs.token()}"
            path.mkdir()
            try:
                fd = _fs.open_dir(path)
            except FileNotFoundError:
                continue  # a concurrent sweep took it before we could lock it
            # Locked and still at our path: otherwise a concurrent sweep got there first.
            if _fs.try_lock(fd) and _same_file(fd, path):
                _fs.fsync_dir(self.snapshots_dir)
                return path, fd
            os.close(fd)
        raise RollsafeError(f"could not create a draft under {self.snapshots_dir}")

    def remove_draft_dir(self, path: Path) -> None:
        self._to_trash([path])

    def publish_draft(
        self, draft: SnapshotDraft, manifest: SnapshotManifest, anchors: Collection[int] = ()
    ) -> PublishedSnapshot:
        """Steps, under the exclusive lock: refuse or reuse an existing snapshot with this
        seq; write manifest.json last and fsync it; rename the draft to its final name (the
        commit point) and fsync ``snapshots/``; point ``LATEST`` at it; apply retention,
        keeping the newest snapshot at each of ``anchors`` (weight versions the trainer holds
        checkpoints of)."""
        with _fs.locked_dir(self.snapshots_dir, exclusive=True):
            existing = self._published_with_seq(manifest.seq)
            if existing is not None:
                return self._reuse(existing, draft, manifest, anchors)
            newest = max(self._published_seqs(), default=None)
            if newest is not None and manifest.seq < newest:
                raise InvalidInput(
                    f"seq {manifest.seq} is older than the newest published seq {newest}"
                )
            final = self.snapshots_dir / snapshot_dir_name(manifest.seq, manifest.kind)
            digest = self._commit(draft, manifest, final)
            self._hit("before_latest")
            self._point_latest(final.name, manifest, digest)
            self._hit("before_retention")
            self._retain(anchors)
        return log_published(self.run_id, PublishedSnapshot(final, manifest, digest, reused=False))

    def _commit(self, draft: SnapshotDraft, manifest: SnapshotManifest, final: Path) -> str:
        try:
            self._hit("before_manifest")
            digest = draft.write_manifest(manifest)
            self._hit("before_rename")
            os.rename(draft.path, final)
        except BaseException:
            draft.unwrite_manifest()
            raise
        draft.mark_published()
        _fs.fsync_dir(self.snapshots_dir)
        return digest

    def _reuse(
        self,
        existing: Path,
        draft: SnapshotDraft,
        manifest: SnapshotManifest,
        anchors: Collection[int],
    ) -> PublishedSnapshot:
        """A published snapshot already has this seq. Same checkpoint: the earlier attempt
        of this publish won (activities run at least once), so return it and finish its
        remaining steps. Anything else is refused and the existing snapshot left as is."""
        try:
            found, digest = verify_snapshot(existing, self.run_id)
        except (SnapshotCorrupt, SchemaMismatch) as exc:
            raise SnapshotCorrupt(
                f"seq {manifest.seq} is already published and does not verify: {exc}"
            ) from None
        refuse_other_checkpoint(existing.name, found, manifest)
        draft.discard()
        log_published(self.run_id, PublishedSnapshot(existing, found, digest, reused=True))
        if found.seq == max(self._published_seqs()):
            pointer = _latest_or_none(self.run_dir)
            if pointer is None or (pointer.snapshot, pointer.manifest_sha256) != (
                existing.name,
                digest,
            ):
                self._point_latest(existing.name, found, digest)
            self._retain(anchors)
        return PublishedSnapshot(existing, found, digest, reused=True)

    def _point_latest(self, name: str, manifest: SnapshotManifest, digest: str) -> None:
        for stray in self.run_dir.glob(f"{_fs.LATEST_TMP_PREFIX}*"):
            stray.unlink(missing_ok=True)  # left by a crash mid-update; we hold the lock
        pointer = LatestPointer(
            run_id=self.run_id,
            snapshot=name,
            seq=manifest.seq,
            kind=manifest.kind,
            checkpoint_id=manifest.checkpoint_id,
            manifest_sha256=digest,
        )
        _fs.write_atomic(self.latest_path, (pointer.model_dump_json(indent=2) + "\n").encode())

    def _retain(self, anchors: Collection[int]) -> None:
        """Apply retention (:mod:`rollsafe.snapshot.retention`). Only manifests are read (not
        every file hashed)."""
        plan = plan_retention(
            self._published(), self._readable_weight_version, self.keep_latest_k, anchors
        )
        doomed = [self.snapshots_dir / name for name in plan.delete]
        doomed = [p for p in doomed if p.is_dir() and not p.is_symlink()]
        self._to_trash(doomed, delete=False)
        log_retention(self.run_id, [p.name for p in doomed], self.keep_latest_k, anchors)

    def mirror(self, name: str) -> FolderMirror | None:
        """Where the run's folder ``name`` (the journal) is copied as its files close: None
        here, the folder is already beside the snapshots; object storage's store returns an
        :class:`~rollsafe.snapshot.remote.ObjectMirror`."""
        return None

    def published_manifests(self) -> builtins.list[SnapshotManifest]:
        """The manifest of every published snapshot that reads back, newest first; no other
        file is read (the journal's compaction asks which positions they cover)."""
        found = (self._readable_manifest(name) for _seq, name in sorted(self._names_here()))
        return sorted((m for m in found if m is not None), key=lambda m: m.seq, reverse=True)

    def _names_here(self) -> builtins.list[tuple[int, str]]:
        return self._published()

    def _readable_weight_version(self, name: str) -> int | None:
        manifest = self._readable_manifest(name)
        return manifest.weight_version if manifest is not None else None

    def _readable_manifest(self, name: str) -> SnapshotManifest | None:
        """``name``'s manifest; None if it does not read back as the snapshot its directory
        name says."""
        try:
            manifest, _digest = load_manifest(self.snapshots_dir / name, self.run_id)
        except (SnapshotCorrupt, SchemaMismatch, OSError):
            return None
        if snapshot_dir_name(manifest.seq, manifest.kind) != name:
            return None
        return manifest

    def _to_trash(self, paths: builtins.list[Path], *, delete: bool = True) -> None:
        """Rename each directory to a trash name (one atomic step out of view), fsync, then
        delete unless ``delete`` is False: retention leaves the bytes to the next begin's
        sweep, off the checkpoint's critical path (at a million rollouts deleting the old
        snapshot cost a tenth of the checkpoint). A crash mid-delete leaves only trash."""
        trashed = []
        for path in paths:
            trash = path.with_name(f"{_fs.TRASH_PREFIX}{path.name}-{_fs.token()}")
            try:
                os.rename(path, trash)
            except FileNotFoundError:
                continue
            trashed.append(trash)
        if trashed:
            _fs.fsync_dir(self.snapshots_dir)
        for trash in trashed if delete else ():
            _fs.remove_tree(trash)

    # -- helpers ---------------------------------------------------------------------------

    def _published(self) -> builtins.list[tuple[int, str]]:
        if not self.snapshots_dir.is_dir():
            return []
        found = []
        for child in self.snapshots_dir.iterdir():
            parsed = _fs.parse_dir_name(child.name)
            if parsed is not None:
                found.append((parsed[0], child.name))
        return found

    def _published_seqs(self) -> builtins.list[int]:
        return [seq for seq, _name in self._published()]

    def _published_with_seq(self, seq: int) -> Path | None:
        names = sorted(name for found, name in self._published() if found == seq)
        return self.snapshots_dir / names[0] if names else None

    def _hit(self, point: str) -> None:
        if self._fault is not None:
            self._fault(point)


# ---- log lines: what operators look for in a store's life ------------------------------------


def log_published(run_id: str, published: PublishedSnapshot) -> PublishedSnapshot:
    """One line per publish (``reused``: an earlier attempt of the same checkpoint had)."""
    manifest = published.manifest
    size = sum(entry.bytes for entry in manifest.files.values())
    log.info(
        "run %s %s snapshot %s (checkpoint %s, weight version %d, %d files, %d bytes)",
        run_id,
        "reused the earlier publish of" if published.reused else "published",
        published.name,
        manifest.checkpoint_id,
        manifest.weight_version,
        len(manifest.files),
        size,
        extra={
            "run_id": run_id,
            "snapshot": published.name,
            "checkpoint_id": manifest.checkpoint_id,
            "reused": published.reused,
            "bytes": size,
        },
    )
    return published


def log_retention(
    run_id: str, deleted: builtins.list[str], keep_latest_k: int, anchors: Collection[int]
) -> None:
    for name in deleted:
        log.info(
            "run %s retention deleted snapshot %s (keeping the newest %d and the newest at "
            "each of %d anchors)",
            run_id,
            name,
            keep_latest_k,
            len(anchors),
            extra={"run_id": run_id, "snapshot": name},
        )


def log_selected(run_id: str, reader: SnapshotReader) -> SnapshotReader:
    """Each newer candidate a restore passed over, and why: one that was refused for damage
    is a WARNING, one not accepted (no trainer checkpoint at its weight version) INFO."""
    for name, why in reader.skipped.items():
        level = logging.INFO if why.startswith("not accepted") else logging.WARNING
        log.log(
            level,
            "run %s: snapshot %s passed over: %s",
            run_id,
            name,
            why,
            extra={"run_id": run_id, "snapshot": name},
        )
    if reader.latest_problem is not None:
        log.warning("run %s: %s", run_id, reader.latest_problem, extra={"run_id": run_id})
    log.debug("run %s: selected snapshot %s", run_id, reader.name)
    return reader


def _latest_or_none(run_dir: Path) -> LatestPointer | None:
    try:
        return read_latest(run_dir)
    except (SnapshotCorrupt, SchemaMismatch):
        return None


def _kind(kind: SnapshotKind | str) -> SnapshotKind:
    try:
        return SnapshotKind(kind)
    except ValueError:
        choices = ", ".join(k.value for k in SnapshotKind)
        raise InvalidInput(f"invalid snapshot kind {kind!r}: expected one of {choices}") from None


def _check_checkpoint_id(checkpoint_id: str) -> None:
    if (
        not isinstance(checkpoint_id, str)
        or not 0 < len(checkpoint_id) <= _MAX_CHECKPOINT_ID
        or not checkpoint_id.isprintable()
    ):
        raise InvalidInput(f"invalid checkpoint id {checkpoint_id!r}")


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = path.lstat()
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def refuse_other_checkpoint(name: str, found: SnapshotManifest, ours: SnapshotManifest) -> None:
    """A seq already published by another checkpoint is never published over."""
    if (found.checkpoint_id, found.kind) != (ours.checkpoint_id, ours.kind):
        raise InvalidInput(
            f"seq {ours.seq} is already published as {name} by checkpoint "
            f"{found.checkpoint_id!r}; refusing to publish checkpoint "
            f"{ours.checkpoint_id!r} ({ours.kind.value}) over it"
        )
