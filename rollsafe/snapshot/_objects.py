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
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from rollsafe.errors import InvalidInput, ObjectStoreUnavailable
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
# Every object-store call is bounded. One that never returns (a black-holed connection:
# botocore's read timeout does not cover a stalled upload; memory:// and file:// have no
# timeout at all) would otherwise hold the controller's publish lock for good: the Temporal
# activity's start_to_close_timeout (workflows/models.py PhaseOptions, 600 s) ends the
# attempt, not the call, so every retry of publish would queue behind it until the snapshot
# failed. A call gets OBJECT_TIMEOUT_S plus time for its bytes at MIN_BYTES_PER_S; past that
# it is abandoned (its thread left to finish or die) and ObjectStoreUnavailable, a transient
# error, makes Temporal retry the phase. A late finish is harmless: an upload writes the same
# bytes again, and every commit is a conditional create that a retry re-checks.
OBJECT_TIMEOUT_S = 60.0
MIN_BYTES_PER_S = 4 << 20
T = TypeVar("T")


def bounded(
    what: str, call: Callable[[], T], *, size: int = 0, timeout_s: float | None = None
) -> T:
    """``call()`` in a daemon thread, given ``timeout_s`` (None: OBJECT_TIMEOUT_S) plus
    ``size`` bytes at MIN_BYTES_PER_S; ObjectStoreUnavailable naming ``what`` when it has not
    returned by then. Its own exceptions are raised here unchanged."""
    limit = (OBJECT_TIMEOUT_S if timeout_s is None else timeout_s) + size / MIN_BYTES_PER_S
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as exc:  # handed to the caller's thread
            future.set_exception(exc)

    thread = threading.Thread(target=run, name="rollsafe-object-call", daemon=True)
    thread.start()
    thread.join(limit)
    if not future.done():
        raise ObjectStoreUnavailable(
            f"{what}: no answer from the object store within {limit:g} s (a hung connection?); "
            "abandoned, retry"
        )
    return future.result()


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


def create_exclusive(fs: Any, path: str, data: bytes, *, timeout_s: float | None = None) -> bool:
    """Create object ``path`` holding ``data`` only if nothing exists there, atomically.
    True when this call created it; False when an object was already there (another writer
    won, or an earlier attempt of this one: callers compare the content)."""
    protocol = _protocol(fs)

    def create() -> None:
        if protocol == "memory":
            with _MEMORY_CREATE:
                fs.pipe_file(path, data, mode="create")
        elif protocol == "file":
            _create_local(Path(path), data)
        else:  # s3fs and gcsfs send the service's own precondition with mode="create"
            fs.pipe_file(path, data, mode="create")

    try:
        bounded(f"conditional create of {path}", create, size=len(data), timeout_s=timeout_s)
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

    def put() -> int:
        if _protocol(fs) == "file":  # the others have no directories to make
            fs.makedirs(fs._parent(remote), exist_ok=True)
        fs.put_file(str(local), remote)
        fs.invalidate_cache(remote)
        return int(fs.info(remote)["size"])

    try:
        size = bounded(f"upload of {remote}", put, size=entry.bytes)
    except OSError as exc:
        raise ObjectStoreUnavailable(f"upload of {remote} failed: {exc}") from exc
    if size != entry.bytes:
        raise ObjectStoreUnavailable(f"{remote}: uploaded {size} bytes, expected {entry.bytes}")
    if reread and hash_object(fs, remote, size=size).sha256 != entry.sha256:
        raise ObjectStoreUnavailable(f"{remote}: read back with a different sha256")


def hash_object(fs: Any, path: str, *, size: int = 0) -> FileEntry:
    """sha256 and size of object ``path`` (``size``: what it is expected to hold, for the
    time limit)."""

    def read() -> FileEntry:
        digest = hashlib.sha256()
        total = 0
        with fs.open(path, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
                total += len(chunk)
        return FileEntry(sha256=digest.hexdigest(), bytes=total)

    try:
        return bounded(f"read back of {path}", read, size=size)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ObjectStoreUnavailable(f"read back of {path} failed: {exc}") from exc


def read_object(fs: Any, path: str, *, timeout_s: float | None = None) -> bytes | None:
    """The bytes of ``path``, None when there is no such object."""
    try:
        return bytes(bounded(f"read of {path}", lambda: fs.cat_file(path), timeout_s=timeout_s))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ObjectStoreUnavailable(f"read of {path} failed: {exc}") from exc


def write_object(fs: Any, path: str, data: bytes, *, timeout_s: float | None = None) -> None:
    """``path`` holding ``data`` (replaced if it exists)."""
    try:
        bounded(f"write of {path}", partial(fs.pipe_file, path, data), timeout_s=timeout_s)
    except OSError as exc:
        raise ObjectStoreUnavailable(f"write of {path} failed: {exc}") from exc
    finally:
        fs.invalidate_cache(path)


def exists(fs: Any, path: str) -> bool:
    fs.invalidate_cache(path)
    try:
        return bool(bounded(f"lookup of {path}", lambda: fs.exists(path)))
    except OSError as exc:
        raise ObjectStoreUnavailable(f"lookup of {path} failed: {exc}") from exc


def list_names(fs: Any, prefix: str, *, timeout_s: float | None = None) -> list[str]:
    """Base names directly under ``prefix`` (objects and prefixes); [] when there is none."""
    fs.invalidate_cache(prefix)
    try:
        paths = bounded(
            f"listing {prefix}", lambda: fs.ls(prefix, detail=False), timeout_s=timeout_s
        )
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ObjectStoreUnavailable(f"listing {prefix} failed: {exc}") from exc
    return sorted({str(path).rstrip("/").rsplit("/", 1)[-1] for path in paths} - {""})


def find_objects(fs: Any, prefix: str) -> list[str]:
    """Every object under ``prefix``, as paths relative to it."""
    return sorted(object_sizes(fs, prefix))


def object_sizes(fs: Any, prefix: str) -> dict[str, int]:
    """Every object under ``prefix`` (as a path relative to it) and its size in bytes."""
    fs.invalidate_cache(prefix)
    try:
        found = bounded(f"listing {prefix}", lambda: fs.find(prefix, detail=True))
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ObjectStoreUnavailable(f"listing {prefix} failed: {exc}") from exc
    base = prefix.rstrip("/") + "/"
    return {
        str(p)[len(base) :]: int(info.get("size") or 0)
        for p, info in found.items()
        if str(p).startswith(base)
    }


def remove_objects(fs: Any, paths: list[str], *, timeout_s: float | None = None) -> None:
    """Delete objects one by one in the given order; ones already gone are fine."""
    for path in paths:
        try:
            bounded(f"delete of {path}", partial(fs.rm_file, path), timeout_s=timeout_s)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ObjectStoreUnavailable(f"delete of {path} failed: {exc}") from exc
        finally:
            fs.invalidate_cache(path)


def download(fs: Any, remote: str, local: Path, *, size: int = 0) -> None:
    """Download object ``remote`` (expected to hold ``size`` bytes, for the time limit)."""
    local.parent.mkdir(parents=True, exist_ok=True)
    try:
        bounded(f"download of {remote}", lambda: fs.get_file(remote, str(local)), size=size)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ObjectStoreUnavailable(f"download of {remote} failed: {exc}") from exc


__all__ = [
    "MIN_BYTES_PER_S",
    "OBJECT_TIMEOUT_S",
    "SCHEMES",
    "ObjectStoreUnavailable",
    "bounded",
    "create_exclusive",
    "download",
    "exists",
    "find_objects",
    "hash_object",
    "list_names",
    "object_sizes",
    "open_filesystem",
    "read_object",
    "remove_objects",
    "upload_verified",
]
