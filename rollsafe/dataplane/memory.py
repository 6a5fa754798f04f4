"""The in-process data plane (docs/design.md section 9): the embedded default, and the one tests
use.

Every stored array is a private C-contiguous copy marked read-only, and ``get`` hands out
read-only views of it: callers cannot change what the plane holds, reads copy nothing, and
``export`` gets a consistent picture by copying the dicts (or the keys it is asked for) alone
(arrays are replaced, never changed in place). The export format is
:mod:`rollsafe.dataplane.columnar`'s.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from rollsafe.dataplane import columnar
from rollsafe.dataplane.columnar import DEFAULT_SHARD_BYTES
from rollsafe.dataplane.protocol import DataPlaneManifest, Row
from rollsafe.dataplane.rows import check_partition, copy_rows, key_list, require_keys
from rollsafe.errors import InvalidInput

_Rows = dict[str, dict[str, np.ndarray]]


class MemoryDataPlane:
    """Rows held in this process; see the module docstring for the copy rules."""

    name = "memory"

    def __init__(self, shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        if shard_bytes < 1:
            raise InvalidInput(f"shard_bytes must be positive, got {shard_bytes}")
        self._shard_bytes = shard_bytes
        self._data: dict[str, _Rows] = {}
        self._lock = threading.Lock()

    def put(self, partition: str, rows: Mapping[str, Row]) -> None:
        staged = copy_rows(partition, rows)
        if staged:
            with self._lock:
                self._data.setdefault(partition, {}).update(staged)

    def get(self, partition: str, keys: Iterable[str]) -> dict[str, dict[str, np.ndarray]]:
        check_partition(partition)
        wanted = key_list(keys)
        with self._lock:
            stored = self._data.get(partition, {})
            require_keys(partition, wanted, stored)
            # A view of a read-only array cannot be made writeable, so callers cannot reach in.
            return {key: {f: a.view() for f, a in stored[key].items()} for key in wanted}

    def list(self, partition: str) -> builtins.list[str]:
        check_partition(partition)
        with self._lock:
            return sorted(self._data.get(partition, ()))

    def count(self, partition: str) -> int:
        check_partition(partition)
        with self._lock:
            return len(self._data.get(partition, ()))

    def delete(self, partition: str, keys: Iterable[str]) -> None:
        check_partition(partition)
        wanted = set(key_list(keys))
        with self._lock:
            stored = self._data.get(partition, {})
            require_keys(partition, wanted, stored)
            for key in wanted:
                del stored[key]
            if not stored:
                self._data.pop(partition, None)

    def clear(self, partition: str | None = None) -> None:
        with self._lock:
            if partition is None:
                self._data = {}
            else:
                check_partition(partition)
                self._data.pop(partition, None)

    def partitions(self) -> builtins.list[str]:
        with self._lock:
            return sorted(name for name, rows in self._data.items() if rows)

    def export(
        self, directory: Path, keys: Mapping[str, Collection[str]] | None = None
    ) -> DataPlaneManifest:
        chosen = keys or {}
        with self._lock:
            held = {name for name, rows in self._data.items() if rows}
            picture = {
                name: _pick(name, self._data.get(name, {}), chosen[name])
                if name in chosen
                else dict(self._data[name])
                for name in held | set(chosen)
            }

        def rows_of(partition: str, keys: Sequence[str]) -> Iterator[tuple[str, Row]]:
            return ((key, picture[partition][key]) for key in keys)

        listed = {name: builtins.list(rows) for name, rows in picture.items()}
        return columnar.write_export(directory, self.name, listed, rows_of, self._shard_bytes)

    def import_(self, directory: Path, manifest: DataPlaneManifest) -> None:
        columnar.check_manifest(manifest, self.name)
        with self._lock:
            self._require_empty()  # before reading what may be gigabytes
        loaded = columnar.read_export(Path(directory), manifest)
        with self._lock:
            self._require_empty()
            self._data = loaded

    def _require_empty(self) -> None:  # the caller holds the lock
        if self._data:
            names = sorted(self._data)
            raise InvalidInput(f"import_ needs an empty data plane; it holds {names} (clear() it)")


def _pick(partition: str, rows: Mapping[str, Row], keys: Collection[str]) -> dict[str, Row]:
    require_keys(partition, keys, rows)
    return {key: rows[key] for key in keys}
