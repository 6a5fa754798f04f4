"""A table of fixed-shape numeric columns keyed by dataset index, kept dense for fast capture.

The ledger and the replay index each hold one row per live group (a million rollouts is a
hundred thousand groups and more). Keeping them as numpy columns instead of Python objects
turns a checkpoint's capture into a handful of array views and its publish into a streamed
write, which is what lets a snapshot run near the disk's own speed. Rows are removed by moving
the last row into the hole, so the live rows are always ``[0, len)``.

A capture copies nothing: it hands out views of the live buffers and marks them shared; the
first write after it into a shared buffer (:meth:`ColumnTable.column`,
:meth:`~ColumnTable.remove`) copies that buffer first, so the capture keeps the bytes it saw
(:meth:`~ColumnTable.add` writes past every captured row and copies nothing). The copy is
paid by the run once per capture and column, after the checkpoint's park window, not inside it
(at a million rollouts the copies are tens of MB: several ms, and tens more when fresh pages
fault in).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from rollsafe.errors import SnapshotCorrupt

KEY_COLUMN = "idx"
COLUMNS_FORMAT_VERSION = "1"


def format_metadata(kind: str, version: str = COLUMNS_FORMAT_VERSION) -> dict[str, str]:
    """The metadata every columns file starts with: what it is and its format version."""
    return {"format": kind, "format_version": version}


def check_metadata(
    metadata: Mapping[str, str],
    kind: str,
    fields: set[str],
    source: str,
    versions: tuple[str, ...] = (COLUMNS_FORMAT_VERSION,),
) -> str:
    """``metadata`` is a ``kind`` file of one of ``versions`` with exactly ``fields`` more;
    returns its version."""
    if metadata.get("format") != kind:
        raise SnapshotCorrupt(f"{source}: not a {kind} file (format {metadata.get('format')!r})")
    version = metadata.get("format_version")
    if version not in versions:
        raise SnapshotCorrupt(f"{source}: unknown {kind} format_version {version!r}")
    expected = {"format", "format_version", *fields}
    if set(metadata) != expected:
        unknown, missing = sorted(set(metadata) - expected), sorted(expected - set(metadata))
        raise SnapshotCorrupt(f"{source}: metadata unknown {unknown}, missing {missing}")
    return str(version)


@dataclass(frozen=True)
class Column:
    dtype: np.dtype[np.generic]
    shape: tuple[int, ...] = ()
    default: int = 0


class ColumnTable:
    def __init__(self, spec: Mapping[str, Column], capacity: int = 64) -> None:
        if KEY_COLUMN in spec:
            raise ValueError(f"column name {KEY_COLUMN!r} is reserved for the key")
        self.spec = dict(spec)
        self._slots: dict[int, int] = {}
        self._keys = np.empty(capacity, dtype=np.int64)
        self._cols = {
            name: np.full((capacity, *col.shape), col.default, dtype=col.dtype)
            for name, col in self.spec.items()
        }
        self._shared: set[str] = set()  # buffers a capture holds views of (KEY_COLUMN: keys)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: int) -> bool:
        return key in self._slots

    def __iter__(self) -> Iterator[int]:
        return iter(self._slots)

    def slot(self, key: int) -> int:
        """Row number of ``key``; raises KeyError when absent (callers name the error)."""
        return self._slots[key]

    def column(self, name: str) -> np.ndarray:
        """The whole buffer of a column, to write into; rows ``[0, len)`` are live. A buffer a
        capture still shares is copied first."""
        self._own(name)
        return self._cols[name]

    def live(self, name: str) -> np.ndarray:
        """The live rows of a column, to read (never to write: a capture may share them)."""
        return self._cols[name][: len(self._slots)]

    def keys_array(self) -> np.ndarray:
        return self._keys[: len(self._slots)]

    def add(self, key: int) -> int:
        if key in self._slots:
            raise KeyError(key)
        # No copy: the new row lies past every row a capture holds.
        slot = len(self._slots)
        if slot == len(self._keys):
            self._grow()
        self._keys[slot] = key
        for name, col in self.spec.items():
            self._cols[name][slot] = col.default
        self._slots[key] = slot
        return slot

    def remove(self, key: int) -> None:
        self._own_all()
        slot = self._slots.pop(key)
        last = len(self._slots)
        if slot != last:
            moved = int(self._keys[last])
            self._keys[slot] = moved
            for array in self._cols.values():
                array[slot] = array[last]
            self._slots[moved] = slot

    def _grow(self) -> None:
        self._shared.clear()  # every buffer is replaced: a capture keeps the old ones
        size = max(64, 2 * len(self._keys))
        self._keys = np.resize(self._keys, size)
        for name, array in self._cols.items():
            grown = np.empty((size, *array.shape[1:]), dtype=array.dtype)
            grown[: len(array)] = array
            self._cols[name] = grown

    def _own(self, name: str) -> None:
        """Copy ``name``'s buffer if a capture shares it (the capture keeps the old one)."""
        if name not in self._shared:
            return
        self._shared.discard(name)
        if name == KEY_COLUMN:
            self._keys = self._keys.copy()
        else:
            self._cols[name] = self._cols[name].copy()

    def _own_all(self) -> None:
        for name in tuple(self._shared):
            self._own(name)

    def capture(self) -> dict[str, np.ndarray]:
        """The live rows as read-only views, in the table's row order (:func:`in_key_order`
        sorts them); they never change afterwards: shared until the table's next write, which
        copies (module doc). No copy and no sort here: a capture is taken inside the park
        window, and a table whose rows were removed is out of key order."""
        views = {KEY_COLUMN: self.keys_array(), **{n: self.live(n) for n in self.spec}}
        self._shared.update(views)
        return {name: _read_only(view) for name, view in views.items()}

    @classmethod
    def from_capture(
        cls, spec: Mapping[str, Column], arrays: Mapping[str, np.ndarray], source: str
    ) -> ColumnTable:
        """Rebuild from :meth:`capture` output in key order (:func:`in_key_order`, as every
        file holds it); any mismatch with ``spec`` is SnapshotCorrupt."""
        expected = {KEY_COLUMN, *spec}
        if set(arrays) != expected:
            unknown = sorted(set(arrays) - expected)
            missing = sorted(expected - set(arrays))
            raise SnapshotCorrupt(f"{source}: columns differ: unknown {unknown}, missing {missing}")
        keys = arrays[KEY_COLUMN]
        rows = len(keys)
        if keys.dtype != np.int64 or keys.ndim != 1:
            raise SnapshotCorrupt(f"{source}: key column must be 1-d int64")
        for name, col in spec.items():
            array = arrays[name]
            if array.dtype != col.dtype or array.shape != (rows, *col.shape):
                raise SnapshotCorrupt(
                    f"{source}: column {name!r} is {array.dtype}{list(array.shape)}, "
                    f"expected {col.dtype}{[rows, *col.shape]}"
                )
        # capture() writes keys strictly increasing; checking that is O(n) and also rules out
        # duplicates, where np.unique would sort.
        if rows and (int(keys[0]) < 0 or not bool((keys[1:] > keys[:-1]).all())):
            raise SnapshotCorrupt(f"{source}: keys are negative, repeated or out of order")
        table = cls(spec, capacity=max(64, rows))
        table._keys[:rows] = keys
        for name in spec:
            table._cols[name][:rows] = arrays[name]
        table._slots = dict(zip(keys.tolist(), range(rows), strict=True))
        return table


def in_key_order(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A capture's rows sorted by key, so equal tables write equal bytes: the arrays
    themselves when already in order (handouts arrive in increasing order: the usual case
    until groups leave), else sorted copies."""
    keys = arrays[KEY_COLUMN]
    if bool((keys[1:] > keys[:-1]).all()):
        return dict(arrays)
    order = np.argsort(keys, kind="stable")
    return {name: array[order] for name, array in arrays.items()}


def _read_only(view: np.ndarray) -> np.ndarray:
    """A read-only view: a capture's reader cannot write into the table's buffer by mistake."""
    view = view.view()
    view.flags.writeable = False
    return view
