"""Reading what a disk holds, bounded: a snapshot, a journal or a pointer may have been damaged,
swapped or crafted, and reading it must end, in bounded memory, with its bytes or a named error.

- :func:`read_regular` reads regular files only: never through a symlink (``O_NOFOLLOW``),
  never blocking on a FIFO (opened non-blocking, then refused by ``fstat``), never a directory
  or a device (``/dev/zero`` would never end), and never more than ``limit`` bytes: a file
  larger than its format allows is refused before it is read. It raises :class:`UnsafeFile`
  (an ``OSError``, so callers' ``except OSError`` names the file as it does for any unreadable
  one).
- :func:`parse_json` parses with bounded nesting (pydantic-core's parser stops at depth 200):
  ``json.loads`` raises ``RecursionError`` on a few thousand ``[``, and that escaped every
  ``except ValueError``. NaN and infinities are refused: nothing rollsafe writes holds them.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import pydantic_core

_CHUNK = 1 << 20


class UnsafeFile(OSError):
    """A path that is not a regular file, or larger than its format allows. Its text is the
    reason alone (also its ``strerror``): callers name the file, as for any unreadable one."""

    def __init__(self, reason: str) -> None:
        super().__init__(errno.EINVAL, reason)

    def __str__(self) -> str:
        return str(self.strerror)


def read_regular(path: Path, limit: int | None = None) -> bytes:
    """The whole content of the regular file at ``path``; :class:`UnsafeFile` for anything
    else or for more than ``limit`` bytes (None: its size, whatever it is)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile("a symbolic link (never followed)") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(f"not a regular file ({_kind(info.st_mode)})")
        if limit is not None and info.st_size > limit:
            raise UnsafeFile(f"{info.st_size} bytes, more than the {limit} it may hold")
        # Read what fstat saw, and one byte more to notice a file growing meanwhile: a
        # concurrent writer is refused rather than read half-way.
        expected = info.st_size
        chunks, total = [], 0
        while total <= expected:
            chunk = os.read(fd, min(_CHUNK, expected + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total != expected:
            raise UnsafeFile(f"changed size while read ({expected}, then {total} bytes)")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


def parse_json(data: bytes | str) -> Any:
    """``data`` as JSON, nesting bounded; ``ValueError`` (naming line and column) when it is
    not JSON, not UTF-8, holds NaN or infinity, or nests too deep."""
    return pydantic_core.from_json(data, allow_inf_nan=False)
