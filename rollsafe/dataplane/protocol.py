"""The data-plane protocol every backend implements (docs/design.md section 9).

A row is a mapping of field name to a numpy array. Rows are keyed by string (a rollout's wire
key for rollout rows, a staging key for generation prefixes) inside named partitions.
Contract:

- ``put`` copies the rows it is given: later changes to the caller's arrays never reach the
  data plane (TransferQueue keeps views into the put batch; rollsafe never relies on that).
- ``count`` is the number of rows in a partition, without listing them.
- ``get`` returns exactly the requested keys or raises :class:`DataPlaneKeyMissing` naming the
  missing ones; it never returns a short result.
- ``export(directory)`` writes every partition into ``directory`` (no pickle; each file listed
  with its sha256 and size in the returned manifest) and ``import_(directory, manifest)`` loads
  it into an empty data plane after checking every file against the manifest.
"""

from __future__ import annotations

import builtins
import hashlib
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

Row = Mapping[str, np.ndarray]


class ExportedFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="path relative to the export directory")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)


class DataPlaneManifest(BaseModel):
    """What ``export`` wrote; enough for ``import_`` to verify and reload it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int = 1
    backend: str
    partitions: dict[str, int] = Field(description="partition -> number of rows")
    files: list[ExportedFile]


def row_digest(row: Row) -> bytes:
    """sha256 over a canonical encoding of a row: field names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for name in sorted(row):
        # The shape comes from the array as given: np.ascontiguousarray turns a 0-d array into
        # shape (1,), which would give a scalar and a one-element vector the same digest.
        given = np.asarray(row[name])
        array = np.ascontiguousarray(given)
        digest.update(f"{name}\x00{given.dtype.str}\x00{given.shape}\x00".encode())
        digest.update(array.data.cast("B") if array.nbytes else b"")
    return digest.digest()


@runtime_checkable
class DataPlane(Protocol):
    name: str

    def put(self, partition: str, rows: Mapping[str, Row]) -> None: ...

    def get(self, partition: str, keys: Iterable[str]) -> dict[str, dict[str, np.ndarray]]: ...

    # builtins.list: in this class body a bare ``list`` would name the method, not the type.
    def list(self, partition: str) -> builtins.list[str]: ...

    def count(self, partition: str) -> int: ...

    def delete(self, partition: str, keys: Iterable[str]) -> None: ...

    def clear(self, partition: str | None = None) -> None: ...

    def partitions(self) -> builtins.list[str]: ...

    def export(
        self, directory: Path, keys: Mapping[str, Collection[str]] | None = None
    ) -> DataPlaneManifest:
        """Every row into the empty ``directory``; a partition named in ``keys`` only those
        keys (each must be there: a missing one is an error, never a smaller export)."""
        ...

    def import_(self, directory: Path, manifest: DataPlaneManifest) -> None: ...
