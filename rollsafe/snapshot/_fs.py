"""Directory layout and the durable-filesystem steps the snapshot store is built from.

Durability rules followed throughout: a file is fsynced after its last write, a directory is
fsynced after an entry in it is created, renamed or removed, and a rename is the only commit
point (POSIX rename within one filesystem is atomic). Locks are ``flock`` locks on directory
file descriptors: the kernel drops them when their holder dies, which is exactly what tells a
draft left by a crash apart from a live one held by a concurrent (Temporal retried) activity.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from rollsafe.core.ids import snapshot_dir_name
from rollsafe.snapshot.manifest import FileEntry, SnapshotKind

SNAPSHOTS_DIR = "snapshots"
LATEST_NAME = "LATEST"
TEMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
LATEST_TMP_PREFIX = ".LATEST.tmp-"
_DIR_NAME = re.compile(r"(?P<seq>[0-9]{8,})-(?P<kind>[a-z]+)")
_CHUNK = 1 << 20
_ExcInfo = tuple[type[BaseException], BaseException, TracebackType]


def parse_dir_name(name: str) -> tuple[int, SnapshotKind] | None:
    """``(seq, kind)`` for a canonical published-snapshot name, else None."""
    match = _DIR_NAME.fullmatch(name)
    if match is None or match["kind"] not in SnapshotKind.__members__.values():
        return None
    seq, kind = int(match["seq"]), SnapshotKind(match["kind"])
    # Only the canonical spelling counts: "000000005-rollout" is not seq 5's directory.
    return (seq, kind) if snapshot_dir_name(seq, kind) == name else None


def token() -> str:
    return secrets.token_hex(6)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs_durable(path: Path) -> None:
    """``mkdir -p`` that fsyncs the parent of every directory it creates."""
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            continue  # a concurrent store created it; its parent entry is its fsync to do
        fsync_dir(directory.parent)


def scan_tree(root: Path) -> tuple[list[str], list[str], list[str]]:
    """``(files, dirs, oddities)`` under ``root`` as sorted POSIX relpaths.

    Symlinks and special files are never followed or accepted: a snapshot read from an
    untrusted disk must not be able to point a restore outside its own directory.
    """
    files: list[str] = []
    dirs: list[str] = []
    oddities: list[str] = []
    _scan(root, "", files, dirs, oddities)
    return sorted(files), sorted(dirs), sorted(oddities)


def _scan(directory: Path, prefix: str, files: list[str], dirs: list[str], odd: list[str]) -> None:
    with os.scandir(directory) as entries:
        for entry in entries:
            rel = prefix + entry.name
            if entry.is_symlink():
                odd.append(rel)
            elif entry.is_dir(follow_symlinks=False):
                dirs.append(rel)
                _scan(Path(entry.path), rel + "/", files, dirs, odd)
            elif entry.is_file(follow_symlinks=False):
                files.append(rel)
            else:
                odd.append(rel)


def hash_file(path: Path, *, sync: bool = False) -> FileEntry:
    """sha256 and size of a regular file in one read; ``sync`` also fsyncs it (for files
    another component wrote into a draft and may not have synced)."""
    digest = hashlib.sha256()
    size = 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        with os.fdopen(fd, "rb", closefd=False) as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return FileEntry(sha256=digest.hexdigest(), bytes=size)


def write_new_synced(path: Path, data: bytes) -> None:
    """Create ``path`` (it must not exist) holding ``data``, fsynced before returning."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: write a temp sibling, fsync, rename, fsync the dir."""
    temp = path.with_name(f".{path.name}.tmp-{token()}")  # LATEST's: LATEST_TMP_PREFIX
    try:
        write_new_synced(temp, data)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def remove_tree(path: Path) -> None:
    """Delete a directory tree; entries already gone (a concurrent sweep) are not an error."""

    shutil.rmtree(path, onerror=_ignore_missing)


def _ignore_missing(func: object, name: str, exc_info: _ExcInfo) -> None:
    error = exc_info[1]
    if not isinstance(error, FileNotFoundError):
        raise error


def open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def try_lock(fd: int) -> bool:
    """Take an exclusive lock without waiting; False when another holder has it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


@contextmanager
def locked_dir(path: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold a blocking flock on directory ``path`` (exclusive to publish, shared to read)."""
    fd = open_dir(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock
