"""Checks every data-plane backend applies on the way in: partition names, keys, rows.

Refused here, at the put, rather than at a checkpoint's export far from the call that caused it.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable, Mapping
from typing import Any

import numpy as np

from rollsafe.errors import DataPlaneKeyMissing, InvalidInput
from rollsafe.snapshot.tensorfile import dtype_name

_PARTITION = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_partition(name: object, error: type[Exception] = InvalidInput) -> str:
    # '.' and '..' match the character class but would walk the directory tree on export.
    if not (isinstance(name, str) and _PARTITION.fullmatch(name) and name not in {".", ".."}):
        raise error(f"partition name {name!r} must be 1-64 of [A-Za-z0-9._-], not '.' or '..'")
    return name


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise InvalidInput(f"data plane key must be a non-empty string, got {key!r}")
    return key


def key_list(keys: Iterable[str]) -> list[str]:
    # A bare string is iterable too; reading it as single-character keys would be a silent bug.
    if isinstance(keys, str):
        raise InvalidInput(f"keys must be an iterable of keys, not the string {keys!r}")
    return [check_key(key) for key in keys]


def require_keys(partition: str, wanted: Iterable[str], held: Container[str]) -> None:
    """Every wanted key is held: a read, a delete or an export is exact, never silently short."""
    if missing := {key for key in wanted if key not in held}:
        raise DataPlaneKeyMissing(partition, missing)


def check_row(partition: str, key: str, row: object) -> dict[str, np.ndarray]:
    """``row``'s arrays after checking them (not copied: see :func:`copy_rows`)."""
    if not isinstance(row, Mapping):
        raise InvalidInput(f"{partition}/{key!r}: a row maps field -> array, got {type(row)}")
    checked: dict[str, np.ndarray] = {}
    for field, value in row.items():
        where = f"partition {partition!r} key {key!r} field {field!r}"
        if not isinstance(field, str):
            raise InvalidInput(f"{where}: field names must be strings")
        if not isinstance(value, np.ndarray):
            raise InvalidInput(f"{where}: expected a numpy array, got {type(value).__name__}")
        # Big-endian too: safetensors would make it little-endian, so not an exact round trip.
        if not _exportable(value.dtype):
            raise InvalidInput(f"{where}: dtype {value.dtype.str} cannot be exported")
        checked[field] = value
    return checked


def check_rows(partition: str, rows: object) -> dict[str, dict[str, np.ndarray]]:
    """Check a whole batch before a backend stores any of it: a bad row stores nothing."""
    check_partition(partition)
    if not isinstance(rows, Mapping):
        raise InvalidInput(f"rows must map key -> row, got {type(rows).__name__}")
    checked: dict[str, dict[str, np.ndarray]] = {}
    for key, row in rows.items():
        name = check_key(key)
        checked[name] = check_row(partition, name, row)
    return checked


def copy_rows(partition: str, rows: object) -> dict[str, dict[str, np.ndarray]]:
    """:func:`check_rows`, then a private, read-only, C-contiguous copy of every array."""
    copied = check_rows(partition, rows)
    for row in copied.values():
        for field, value in row.items():
            array = np.array(value, copy=True, order="C")
            array.setflags(write=False)
            row[field] = array
    return copied


def _exportable(dtype: np.dtype[Any]) -> bool:
    try:
        dtype_name(dtype)
    except ValueError:
        return False
    return dtype.byteorder != ">"
