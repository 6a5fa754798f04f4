"""Object-storage primitives for the remote snapshot store, over fsspec.

Object stores have no rename and no directory lock, so the remote store is built from two
primitives only, and this module is where each backend's spelling of them lives:

- an upload whose result is checked (size, and sha256 by reading the object back);
- a conditional create: write an object only if no object has that key, atomically, so of
  two concurrent writers exactly one wins (S3 ``PutObject`` with ``If-None-Match: *``, GCS
  ``ifGenerationMatch=0``, ``O_EXCL``-style for local files, a process lock for memory://).

Only backends whose conditional create is known to be atomic are accepted: a backend that
silently overwrote (fsspec's generic ``pipe_file(mode="create")`` is check-then-write) would
let two publishers both win.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rollsafe.errors import InvalidInput, TransientError
from rollsafe.snapshot._fs import token, write_new_synced
from rollsafe.snapshot.manifest import FileEntry

# scheme -> the fsspec protocol and the package that provides it
SCHEMES: dict[str, tuple[str, str | None]] = {
    "s3": ("s3", "s3fs"),
    "gs": ("gcs", "gcsfs"),
    "gcs": ("gcs", "gcsfs"),
    "memory": ("memory", None),  # tests: one process
    "file": ("file", None),  # tests; a shared POSIX path should use SnapshotStore itself
}
_CHUNK = 1 << 20
_MEMORY_CREATE = threading.Lock()  # memory:// checks then creates: make that one step


class ObjectStoreUnavailable(TransientError):
    """The object store did not answer or refused a request for a reason that may pass
    (a network error, throttling, S3's 409 ConditionalRequestConflict)."""


def open_filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``(filesystem, root path without scheme)`` for ``url``; InvalidInput names an
    unsupported scheme or a backend package that is not installed."""
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        supported = ", ".join(f"{name}://" for name in SCHEMES)
        raise InvalidInput(
            f"unsupported snapshot storage scheme {scheme!r} in {url!r}: supported are "
            f"{supported} (a shared POSIX path is a plain directory: use SnapshotStore)"
        )
    protocol, package = SCHEMES[scheme]
    try:
        import fsspec  # optional dependency: imported when used
    except ImportError:
        raise InvalidInput(
            f"{url!r}: object storage needs fsspec: pip install 'rollsafe[object-storage]'"
        ) from None
    try:
        fs = fsspec.filesystem(protocol, **(storage_options or {}))
    except ImportError:
        raise InvalidInput(
            f"{url!r}: the {scheme}:// backend needs the {package!r} package: "
            "pip install 'rollsafe[object-storage]'"
        ) from None
    root = fs._strip_protocol(url).rstrip("/")
    if not root:
        raise InvalidInput(f"{url!r}: no bucket or path after the scheme")
    return fs, root


def create_exclusive(fs: Any, path: str, data: bytes) -> bool:
    """Create object ``path`` holding ``data`` only if nothing exists there, atomically.
    True when this call created it; False when an object was already there (another writer
    won, or an earlier attempt of this one: callers compare the content)."""
    protocol = _protocol(fs)
    try:
        if protocol == "memory":
            with _MEMORY_CREATE:
                fs.pipe_file(path, data, mode="create")
        elif protocol == "file":
            _create_local(Path(path), data)
        else:  # s3fs and gcsfs send the service's own precondition with mode="create"
            fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        return False
    except OSError as exc:
        if _precondition_failed(exc):
            return False
        raise ObjectStoreUnavailable(f"conditional create of {path} failed: {exc}") from exc
    finally:
        fs.invalidate_cache(path)
    return True


def _create_local(path: Path, data: bytes) -> None:
    # Write a complete temp file, then link it into place: link fails if the name exists
    # (atomic, like O_EXCL) and a reader never sees a half-written object.
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp-{token()}")
    try:
        write_new_synced(temp, data)
        os.link(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def _precondition_failed(exc: OSError) -> bool:
    # s3fs maps a 412 to FileExistsError when the service names the condition, and to
    # EINVAL "PreconditionFailed" when it does not (some S3-compatible servers).
    text = str(exc)
    return exc.errno == errno.EINVAL and ("PreconditionFailed" in text or "pre-condition" in text)


def _protocol(fs: Any) -> str:
    protocol = fs.protocol
    return str(protocol if isinstance(protocol, str) else protocol[0])


def upload_verified(fs: Any, local: Path, remote: str, entry: FileEntry, *, reread: bool) -> None:
    """Upload one file and check the object: its size always, its sha256 when ``reread``."""
    try:
        if _protocol(fs) == "file":  # the others have no directories to make
            fs.makedirs(fs._parent(remote), exist_ok=True)
        fs.put_file(str(local), remote)
        fs.invalidate_cache(remote)
        size = fs.info(remote)["size"]
    except OSError as exc:
        raise ObjectStoreUnavailable(f"upload of {remote} failed: {exc}") from exc
    if size != entry.bytes:
        raise ObjectStoreUnavailable(f"{remote}: uploaded {size} bytes, expected {entry.bytes}")
    if reread and hash_object(fs, remote).sha256 != entry.sha256:
        raise ObjectStoreUnavailable(f"{remote}: read back with a different sha256")


def hash_object(fs: Any, path: str) -> FileEntry:
    digest = hashlib.sha256()
    size = 0
    with fs.open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileEntry(sha256=digest.hexdigest(), bytes=size)


def read_object(fs: Any, path: str) -> bytes | None:
    """The bytes of ``path``, None when there is no such object."""
    try:
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ObjectStoreUnavailable(f"read of {path} failed: {exc}") from exc


def list_names(fs: Any, prefix: str) -> list[str]:
    """Base names directly under ``prefix`` (objects and prefixes); [] when there is none."""
    fs.invalidate_cache(prefix)
    try:
        paths = fs.ls(prefix, detail=False)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ObjectStoreUnavailable(f"listing {prefix} failed: {exc}") from exc
    return sorted({str(path).rstrip("/").rsplit("/", 1)[-1] for path in paths} - {""})


def find_objects(fs: Any, prefix: str) -> list[str]:
    """Every object under ``prefix``, as paths relative to it."""
    fs.invalidate_cache(prefix)
    try:
        paths = fs.find(prefix, detail=False)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ObjectStoreUnavailable(f"listing {prefix} failed: {exc}") from exc
    base = prefix.rstrip("/") + "/"
    return sorted(str(p)[len(base) :] for p in paths if str(p).startswith(base))


def remove_objects(fs: Any, paths: list[str]) -> None:
    """Delete objects one by one in the given order; ones already gone are fine."""
    for path in paths:
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ObjectStoreUnavailable(f"delete of {path} failed: {exc}") from exc
        finally:
            fs.invalidate_cache(path)


def download(fs: Any, remote: str, local: Path) -> None:
    local.parent.mkdir(parents=True, exist_ok=True)
    try:
        fs.get_file(remote, str(local))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ObjectStoreUnavailable(f"download of {remote} failed: {exc}") from exc


__all__ = [
    "SCHEMES",
    "ObjectStoreUnavailable",
    "create_exclusive",
    "download",
    "find_objects",
    "hash_object",
    "list_names",
    "open_filesystem",
    "read_object",
    "remove_objects",
    "upload_verified",
]
