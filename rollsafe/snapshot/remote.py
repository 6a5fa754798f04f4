"""Snapshots on object storage (s3://, gs://) with the POSIX store's publish semantics.

A draft is staged on local disk exactly as with :class:`SnapshotStore` (the capture, the
data-plane export and the environments' exports all write files into ``draft.path``);
publish uploads it. Layout under ``<url>``::

    <run_id>/claims/<seq:08d>.json                    conditional create, first: who owns seq
    <run_id>/snapshots/<seq:08d>-<kind>/<relpath>     every file, uploaded and read back
    <run_id>/snapshots/<seq:08d>-<kind>/manifest.json conditional create, last: the commit point
    <run_id>/latest/<seq:08d>.json                    LATEST: conditional create, newest wins

Object stores have neither rename nor a lock, so every commit is a conditional create
(``If-None-Match: *`` on S3, ``ifGenerationMatch=0`` on GCS): of two publishers of a seq
exactly one gets the claim, so only one uploads, and exactly one manifest and one ``LATEST``
entry exist per seq. ``LATEST`` is a set of immutable pointers (a single object cannot be
replaced conditionally through fsspec); the newest one is the pointer, so it never goes
backwards (the claims and pointers are :mod:`rollsafe.snapshot._pointers`). A snapshot without
``manifest.json`` is invisible: a publish that died before it left only unreferenced objects,
which retention deletes once older snapshots are kept.

Reading downloads a snapshot into ``<cache_dir>/<run_id>/snapshots/<name>`` and verifies it
with the POSIX code (:func:`verify_snapshot`); the returned :class:`SnapshotReader` is the
ordinary local one, so :func:`rollsafe.snapshot.state_files.restore` takes this store as it
takes a local one.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from rollsafe.core.config import KEEP_LATEST_K
from rollsafe.core.ids import snapshot_dir_name
from rollsafe.errors import InvalidInput, NoValidSnapshot, SchemaMismatch, SnapshotCorrupt
from rollsafe.snapshot import _fs
from rollsafe.snapshot import _objects as objects
from rollsafe.snapshot import _pointers as pointers
from rollsafe.snapshot.bounded import read_regular
from rollsafe.snapshot.draft import SnapshotDraft
from rollsafe.snapshot.manifest import (
    MANIFEST_NAME,
    LatestPointer,
    SnapshotManifest,
    parse_manifest,
    relpath_problem,
)
from rollsafe.snapshot.retention import plan_retention
from rollsafe.snapshot.select import (
    Accept,
    EntryState,
    SnapshotEntry,
    SnapshotReader,
    verify_snapshot,
)
from rollsafe.snapshot.store import (
    FaultHook,
    PublishedSnapshot,
    SnapshotStore,
    log_published,
    log_retention,
    log_selected,
    refuse_other_checkpoint,
)

_Refused = (SnapshotCorrupt, SchemaMismatch)


class ObjectMirror:
    """Whole files of a local folder copied to ``prefix`` on object storage (the journal's
    closed segments, docs/journal.md): uploaded once closed, fetched by a restore on a host
    that lacks them."""

    def __init__(self, fs: Any, prefix: str) -> None:
        self.fs, self.prefix = fs, prefix

    def upload(self, path: Path) -> None:
        objects.write_object(self.fs, f"{self.prefix}/{path.name}", path.read_bytes())

    def names(self) -> builtins.list[str]:
        return objects.list_names(self.fs, self.prefix)

    def fetch(self, name: str, directory: Path) -> None:
        """Download ``name`` into ``directory`` under a temporary name, then rename: a partial
        download never looks like a file of the folder."""
        partial = directory / f".{name}.part"
        objects.download(self.fs, f"{self.prefix}/{name}", partial)
        partial.replace(directory / name)

    def remove(self, names: builtins.list[str]) -> None:
        objects.remove_objects(self.fs, [f"{self.prefix}/{name}" for name in names])


class RemoteSnapshotStore(SnapshotStore):
    """A run's snapshots under an fsspec URL; drafts and downloads under ``cache_dir``.

    ``verify_uploads`` reads every uploaded object back and checks its sha256 (its size is
    always checked); select verifies every digest again after download either way.
    """

    def __init__(
        self,
        url: str,
        run_id: str,
        cache_dir: Path | str,
        keep_latest_k: int = KEEP_LATEST_K,
        *,
        storage_options: dict[str, Any] | None = None,
        fault_hook: FaultHook | None = None,
        verify_uploads: bool = True,
    ) -> None:
        self.fs, base = objects.open_filesystem(url, storage_options)  # refuses a bad scheme
        super().__init__(Path(cache_dir), run_id, keep_latest_k, fault_hook=fault_hook)
        self.url = url.rstrip("/")
        self.remote_run = f"{base}/{self.run_id}"
        self.verify_uploads = verify_uploads

    def _remote(self, *parts: str) -> str:
        return "/".join((self.remote_run, *parts))

    def mirror(self, name: str) -> ObjectMirror:
        """The run's folder ``name`` beside its snapshots on object storage."""
        return ObjectMirror(self.fs, self._remote(name))

    def _where(self, name: str) -> str:
        return f"{self.url}/{self.run_id}/{_fs.SNAPSHOTS_DIR}/{name}"

    # -- reading ---------------------------------------------------------------------------

    def select(
        self,
        accept: Accept | None = None,
        *,
        contents: bool = True,
        refused: Mapping[str, str] | None = None,
    ) -> SnapshotReader:
        """Newest remote snapshot whose manifest exists, that ``accept`` takes and that
        verifies after download; NoValidSnapshot names every refused candidate. Downloading
        reads every byte anyway, so the copy is always verified whole (``contents`` is
        ignored); ``refused`` as for the local store."""
        del contents
        candidates, reasons = self._candidates()
        for _seq, name in candidates:
            if refused is not None and name in refused:
                reasons[name] = refused[name]
                continue
            try:
                manifest = self._read_manifest(name)
                if accept is not None and (why := accept(manifest)) is not None:
                    reasons[name] = f"not accepted: {why}"
                    continue
                path, manifest, digest = self._fetch(name)
            except _Refused as exc:
                reasons[name] = str(exc)
                continue
            problem = self._latest_problem(name, digest)
            return log_selected(
                self.run_id, SnapshotReader(path, manifest, digest, reasons, problem)
            )
        if (problem := self._latest_problem(None, None)) is not None:
            reasons[_fs.LATEST_NAME] = problem
        raise NoValidSnapshot(f"{self.url}/{self.run_id}/{_fs.SNAPSHOTS_DIR}", reasons)

    def list(self, *, verify: bool = True) -> builtins.list[SnapshotEntry]:
        """Remote entries newest first; ``verify`` downloads and verifies each published one.
        Paths are where the local copy lives (or would live) under ``cache_dir``."""
        entries = []
        for seq, name in self._names():
            parsed = _fs.parse_dir_name(name)
            assert parsed is not None  # _names only returns canonical names
            kind = parsed[1]
            local = self.snapshots_dir / name
            if not self._has_manifest(name):
                why = "no manifest.json: unpublished (a publish in progress or that died)"
                entries.append(SnapshotEntry(name, local, EntryState.TEMP, seq, kind, why))
            elif not verify:
                entries.append(SnapshotEntry(name, local, EntryState.UNCHECKED, seq, kind))
            else:
                try:
                    path, manifest, _digest = self._fetch(name)
                except _Refused as exc:
                    entry = SnapshotEntry(name, local, EntryState.INVALID, seq, kind, str(exc))
                else:
                    entry = SnapshotEntry(name, path, EntryState.VALID, seq, kind, None, manifest)
                entries.append(entry)
        return entries

    def verify_published(self, seq: int) -> PublishedSnapshot | None:
        """The published snapshot with ``seq`` (its manifest exists), downloaded into the
        cache and verified there: the cache may be gone (another host, a wiped disk), the
        bucket is the truth. None when no snapshot with this seq is published."""
        for found, name in self._candidates()[0]:
            if found == seq:
                path, manifest, digest = self._fetch(name)
                return PublishedSnapshot(path, manifest, digest, reused=True)
        return None

    def latest_pointer(self) -> LatestPointer | None:
        """The newest ``latest/<seq>.json`` pointer; SnapshotCorrupt if it does not parse."""
        return pointers.newest_pointer(self.fs, self._remote(pointers.POINTERS_DIR))

    def _latest_problem(self, selected: str | None, digest: str | None) -> str | None:
        return pointers.pointer_problem(
            self.fs, self._remote(pointers.POINTERS_DIR), self.run_id, selected, digest
        )

    def _names(self) -> builtins.list[tuple[int, str]]:
        """``(seq, name)`` of every canonical snapshot prefix, newest first."""
        found = []
        for name in objects.list_names(self.fs, self._remote(_fs.SNAPSHOTS_DIR)):
            if (parsed := _fs.parse_dir_name(name)) is not None:
                found.append((parsed[0], name))
        return sorted(found, reverse=True)

    def _candidates(self) -> tuple[builtins.list[tuple[int, str]], dict[str, str]]:
        """Published names (manifest present), newest first, and why the others are not."""
        candidates, reasons = [], {}
        for name in objects.list_names(self.fs, self._remote(_fs.SNAPSHOTS_DIR)):
            parsed = _fs.parse_dir_name(name)
            if parsed is None:
                reasons[name] = "not a snapshot name (ignored)"
            elif not self._has_manifest(name):
                reasons[name] = "no manifest.json: unpublished (ignored)"
            else:
                candidates.append((parsed[0], name))
        return sorted(candidates, reverse=True), reasons

    def _manifest_path(self, name: str) -> str:
        return self._remote(_fs.SNAPSHOTS_DIR, name, MANIFEST_NAME)

    def _has_manifest(self, name: str) -> bool:
        return objects.exists(self.fs, self._manifest_path(name))

    def _read_manifest(self, name: str) -> SnapshotManifest:
        data = objects.read_object(self.fs, self._manifest_path(name))
        if data is None:
            raise SnapshotCorrupt(f"{self._where(name)}: no {MANIFEST_NAME} (being deleted?)")
        try:
            manifest = parse_manifest(data, MANIFEST_NAME, self.run_id)
        except _Refused as exc:
            raise type(exc)(f"{self._where(name)}: {exc}") from None
        if snapshot_dir_name(manifest.seq, manifest.kind) != name:
            raise SnapshotCorrupt(f"{self._where(name)}: manifest says seq {manifest.seq}")
        return manifest

    def _fetch(self, name: str) -> tuple[Path, SnapshotManifest, str]:
        """Download every object of ``name`` and verify the copy with the POSIX code; on
        success it replaces the cached copy at ``snapshots_dir/name``. Errors name the
        remote snapshot and the file."""
        prefix = self._remote(_fs.SNAPSHOTS_DIR, name)
        sizes = objects.object_sizes(self.fs, prefix)
        keys = sorted(sizes)
        odd = [k for k in keys if k != MANIFEST_NAME and relpath_problem(k) is not None]
        if odd:
            raise SnapshotCorrupt(f"{self._where(name)}: object key(s) not allowed: {odd[:5]}")
        staging = self.run_dir / f".fetch-{_fs.token()}"
        local = staging / name
        try:
            try:
                for key in keys:
                    objects.download(self.fs, f"{prefix}/{key}", local / key, size=sizes[key])
                local.mkdir(parents=True, exist_ok=True)
                manifest, digest = _verify_local(local, self.run_id)
            except _Refused as exc:
                raise type(exc)(f"{self._where(name)}: {exc}") from None
            except FileNotFoundError:
                raise SnapshotCorrupt(f"{self._where(name)}: deleted while read") from None
            final = self.snapshots_dir / name
            _fs.make_dirs_durable(self.snapshots_dir)
            self._to_trash([final])
            os.rename(local, final)
        finally:
            _fs.remove_tree(staging)
        return final, manifest, digest

    # -- writing ---------------------------------------------------------------------------

    def _published_seqs(self) -> builtins.list[int]:
        # Every remote seq counts, published or not, and every claim: begin(seq=None)
        # must not pick a seq that another publisher is uploading.
        seqs = [seq for seq, _name in self._names()]
        claims = objects.list_names(self.fs, self._remote(pointers.CLAIMS_DIR))
        return seqs + [seq for name in claims if (seq := pointers.seq_of(name)) is not None]

    def publish_draft(
        self, draft: SnapshotDraft, manifest: SnapshotManifest, anchors: Collection[int] = ()
    ) -> PublishedSnapshot:
        """Claim the seq, upload and check every file, create the manifest (the commit
        point), create this seq's LATEST pointer, apply retention (keeping the newest
        snapshot at each of ``anchors``). A seq already published by this checkpoint is
        reused (activities run at least once); by another, refused."""
        name = snapshot_dir_name(manifest.seq, manifest.kind)
        published = self._candidates()[0]
        if existing := [n for seq, n in published if seq == manifest.seq]:
            return self._reuse_remote(existing[0], draft, manifest, anchors)
        if published and manifest.seq < published[0][0]:
            raise InvalidInput(
                f"seq {manifest.seq} is older than the newest published seq {published[0][0]}"
            )
        pointers.claim_seq(self.fs, self._remote(pointers.CLAIMS_DIR), self.run_id, manifest)
        prefix = self._remote(_fs.SNAPSHOTS_DIR, name)
        for relpath, entry in sorted(manifest.files.items()):
            objects.upload_verified(
                self.fs, draft.path / relpath, f"{prefix}/{relpath}", entry,
                reread=self.verify_uploads,
            )  # fmt: skip
        try:
            self._hit("before_manifest")
            digest = draft.write_manifest(manifest)
            self._hit("before_rename")
            data = read_regular(draft.path / MANIFEST_NAME)
            won = objects.create_exclusive(self.fs, self._manifest_path(name), data)
        except BaseException:
            draft.unwrite_manifest()
            raise
        if not won:  # an attempt of this same checkpoint (it holds the claim) got there first
            draft.unwrite_manifest()
            return self._reuse_remote(name, draft, manifest, anchors)
        local = self._keep_local(draft, name)
        self._hit("before_latest")
        self._point_latest_remote(name, manifest, digest)
        self._hit("before_retention")
        self._retain_remote(anchors)
        return log_published(self.run_id, PublishedSnapshot(local, manifest, digest, reused=False))

    def _reuse_remote(
        self,
        name: str,
        draft: SnapshotDraft,
        manifest: SnapshotManifest,
        anchors: Collection[int],
    ) -> PublishedSnapshot:
        try:
            path, found, digest = self._fetch(name)
        except _Refused as exc:
            raise SnapshotCorrupt(
                f"seq {manifest.seq} is already published and does not verify: {exc}"
            ) from None
        refuse_other_checkpoint(name, found, manifest)
        draft.discard()
        self._point_latest_remote(name, found, digest)
        self._retain_remote(anchors)
        return log_published(self.run_id, PublishedSnapshot(path, found, digest, reused=True))

    def _keep_local(self, draft: SnapshotDraft, name: str) -> Path:
        """The uploaded draft becomes the cached copy of the snapshot (no second download
        for a restore on this machine; select still verifies the remote one)."""
        final = self.snapshots_dir / name
        self._to_trash([final])
        os.rename(draft.path, final)
        draft.mark_published()
        _fs.fsync_dir(self.snapshots_dir)
        return final

    def _point_latest_remote(self, name: str, manifest: SnapshotManifest, digest: str) -> None:
        folder = self._remote(pointers.POINTERS_DIR)
        pointers.create_pointer(self.fs, folder, self.run_id, name, manifest, digest)

    def _retain_remote(self, anchors: Collection[int]) -> None:
        """Apply retention (:mod:`rollsafe.snapshot.retention`) to every snapshot prefix
        (published or a dead upload): each one deleted goes manifest first, so a half-deleted
        snapshot is invisible, then its files, pointer and claim; then claims and pointers of
        seqs that never got a prefix, below the cut; then local copies no longer kept."""
        names = self._names()
        plan = plan_retention(names, self._remote_weight_version, self.keep_latest_k, anchors)
        for seq, name in [(seq, name) for seq, name in names if name in plan.delete]:
            prefix = self._remote(_fs.SNAPSHOTS_DIR, name)
            objects.remove_objects(self.fs, [self._manifest_path(name)])
            rest = [f"{prefix}/{key}" for key in objects.find_objects(self.fs, prefix)]
            objects.remove_objects(
                self.fs,
                [
                    *rest,
                    self._remote(pointers.POINTERS_DIR, pointers.seq_file(seq)),
                    self._remote(pointers.CLAIMS_DIR, pointers.seq_file(seq)),
                ],
            )
            log_retention(self.run_id, [name], self.keep_latest_k, anchors)
        if plan.cut is not None:
            kept = {seq for seq, name in names if name in plan.keep}
            for folder in (pointers.CLAIMS_DIR, pointers.POINTERS_DIR):
                orphans = [
                    self._remote(folder, n)
                    for n in objects.list_names(self.fs, self._remote(folder))
                    if (old := pointers.seq_of(n)) is not None
                    and old < plan.cut
                    and old not in kept
                ]
                objects.remove_objects(self.fs, orphans)
        if self.snapshots_dir.is_dir():
            local = [
                child
                for child in self.snapshots_dir.iterdir()
                if _fs.parse_dir_name(child.name) is not None and child.name not in plan.keep
            ]
            self._to_trash(local, delete=False)

    def _remote_weight_version(self, name: str) -> int | None:
        manifest = self._readable_manifest(name)
        return manifest.weight_version if manifest is not None else None

    def _names_here(self) -> builtins.list[tuple[int, str]]:
        return self._names()

    def _readable_manifest(self, name: str) -> SnapshotManifest | None:
        try:
            return self._read_manifest(name)
        except _Refused:
            return None  # unpublished or damaged


def _verify_local(path: Path, run_id: str) -> tuple[SnapshotManifest, str]:
    try:
        return verify_snapshot(path, run_id)
    except _Refused as exc:
        # verify_snapshot prefixes the local download path; the caller names the remote one
        raise type(exc)(str(exc).removeprefix(f"{path}: ")) from None
