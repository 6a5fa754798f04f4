"""The data plane on TransferQueue 0.1.11 (docs/design.md section 9; facts in docs/platform.md).

TransferQueue holds the rows; rollsafe keeps everything it needs to trust them in each row's
tag (TransferQueue's per-key custom metadata): the key itself, every field's dtype and shape,
and the row's sha256 (:func:`~rollsafe.dataplane.protocol.row_digest`). So:

- a read compares what came back with what was asked, key by key, and names any key that is
  missing (a multi-key ``kv_batch_get`` silently drops unknown keys), or that was registered by
  a put that never finished (no tag);
- each row is checked against its digest on every read: a torn or mixed-up row is an error,
  never data;
- each read asks for exactly the row's own fields (TransferQueue returns the fields all
  requested rows share), so rows of different shapes and field sets mix freely;
- nothing relies on TransferQueue's global indexes (reused across partitions).

Each field is stored flattened, as a jagged column named ``<field>:<dtype>`` (``tokens:i8``;
TransferQueue allows one dtype per column in a partition, the protocol allows any per row),
readable by any TransferQueue client, and reshaped from the tag. Storage units keep views into
the put batch; the ``data_parser`` here clones each row where it is stored, so a row never pins
its batch.

A plane owns a namespace: its partitions are ``<namespace>/<partition>`` in TransferQueue, so
several planes (a run and its restore, tests) share one TransferQueue without seeing each
other, and a fresh plane is empty. ``export`` streams rows out in batches into the columnar
format of :mod:`rollsafe.dataplane.columnar` (never TransferQueue's own checkpoint, which
pickles and is torn under live writers); ``import_`` loads one into an empty namespace.
"""

from __future__ import annotations

import builtins
import math
import re
import uuid
import warnings
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import numpy as np

from rollsafe.dataplane import columnar, tq_runtime
from rollsafe.dataplane.columnar import DEFAULT_SHARD_BYTES
from rollsafe.dataplane.protocol import DataPlaneManifest, Row, row_digest
from rollsafe.dataplane.rows import check_partition, check_rows, key_list, require_keys
from rollsafe.errors import (
    DataPlaneCorrupt,
    DataPlaneKeyMissing,
    DataPlaneUnavailable,
    InvalidInput,
    RollsafeError,
)

TAG_VERSION: Final = 1
# Rows per TransferQueue call: large enough to amortise its ~3 ms round trip, small enough
# that one batch is a few MB at 8k-token rows.
BATCH_ROWS = 256
_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,64}")

_Rows = dict[str, dict[str, np.ndarray]]
_Schema = tuple[tuple[str, str], ...]  # (field, dtype.str), sorted by field


def clone_each_row(columns: dict[str, Any]) -> dict[str, Any]:
    """TransferQueue ``data_parser``, run inside the storage unit: one private tensor per row,
    so a stored row does not keep the whole put batch alive (docs/platform.md)."""
    return {
        name: [row.clone() for row in (value if isinstance(value, list) else value.unbind(0))]
        for name, value in columns.items()
    }


class TransferQueueDataPlane:
    """See the module docstring. Needs Ray and a running TransferQueue
    (:func:`rollsafe.dataplane.tq_runtime.start_transferqueue`)."""

    name = "transferqueue"

    def __init__(
        self, namespace: str | None = None, *, shard_bytes: int = DEFAULT_SHARD_BYTES
    ) -> None:
        namespace = namespace if namespace is not None else f"rs-{uuid.uuid4().hex[:12]}"
        if not _NAMESPACE.fullmatch(namespace):
            raise InvalidInput(f"namespace {namespace!r} must be 1-64 of [A-Za-z0-9._-]")
        if shard_bytes < 1:
            raise InvalidInput(f"shard_bytes must be positive, got {shard_bytes}")
        self.namespace = namespace
        self._shard_bytes = shard_bytes
        self._client = tq_runtime.attach()

    # ---- the protocol ----------------------------------------------------------------------

    def put(self, partition: str, rows: Mapping[str, Row]) -> None:
        # Every row is checked before any is sent. TransferQueue failing part-way through a
        # batch of several calls (DataPlaneUnavailable) may leave some rows stored: putting the
        # same rows again is safe, a put replaces whole rows.
        checked = check_rows(partition, rows)
        by_schema: dict[_Schema, list[str]] = {}
        for key, row in checked.items():
            by_schema.setdefault(_schema(row), []).append(key)
        for schema, keys in sorted(by_schema.items()):
            for start in range(0, len(keys), BATCH_ROWS):
                batch = {key: checked[key] for key in keys[start : start + BATCH_ROWS]}
                self._put_batch(partition, schema, batch)

    def get(self, partition: str, keys: Iterable[str]) -> dict[str, dict[str, np.ndarray]]:
        check_partition(partition)
        wanted = key_list(keys)
        unique = list(dict.fromkeys(wanted))
        batches = [unique[i : i + BATCH_ROWS] for i in range(0, len(unique), BATCH_ROWS)]
        metas, missing = [], set()
        for batch in batches:  # every batch checked before any is read: all missing keys named
            try:
                metas.append(self._meta(partition, batch))
            except DataPlaneKeyMissing as exc:
                missing.update(exc.missing)
        if missing:
            raise DataPlaneKeyMissing(partition, missing)
        rows: _Rows = {}
        for batch, meta in zip(batches, metas, strict=True):
            rows.update(self._get_batch(partition, batch, meta))
        return {key: rows[key] for key in wanted}

    def list(self, partition: str) -> builtins.list[str]:
        return sorted(self._tags(check_partition(partition)))

    def count(self, partition: str) -> int:
        return len(self._tags(check_partition(partition)))

    def delete(self, partition: str, keys: Iterable[str]) -> None:
        check_partition(partition)
        unique = list(dict.fromkeys(key_list(keys)))
        if not unique:
            return
        meta = self._meta(partition, unique)  # names missing keys before deleting any
        self._call("delete", lambda: self._client.clear_samples(meta))

    def clear(self, partition: str | None = None) -> None:
        names = [check_partition(partition)] if partition is not None else self._own()
        for name in names:
            self._call("clear", lambda name=name: self._client.clear_partition(self._tq(name)))

    def partitions(self) -> builtins.list[str]:
        return [name for name in self._own() if self._tags(name)]

    def export(
        self, directory: Path, keys: Mapping[str, Collection[str]] | None = None
    ) -> DataPlaneManifest:
        """Every row of this namespace (of a partition named in ``keys``, those keys), read in
        batches (the next batch is fetched while the current one is written). A key deleted
        mid-export fails it: it never exports a torn picture."""
        chosen = keys or {}
        listed = {name: builtins.list(self._tags(name)) for name in self._own()}
        for name, wanted in chosen.items():
            require_keys(name, wanted, set(listed.get(name, ())))
            listed[name] = builtins.list(wanted)
        picked = {name: tags for name, tags in listed.items() if tags}
        return columnar.write_export(
            directory, self.name, picked, self._stream_rows, self._shard_bytes
        )

    def import_(self, directory: Path, manifest: DataPlaneManifest) -> None:
        columnar.check_manifest(manifest, self.name)
        self._require_empty()  # before reading what may be gigabytes
        loaded = columnar.read_export(Path(directory), manifest)
        self._require_empty()
        try:
            for partition, rows in sorted(loaded.items()):
                self.put(partition, rows)
            for partition, expected in manifest.partitions.items():
                if (found := self.count(partition)) != expected:
                    raise DataPlaneUnavailable(
                        f"import into {self.namespace}/{partition}: {found} rows readable "
                        f"after putting {expected}"
                    )
        except BaseException:
            self.clear()  # all or nothing: no half-imported namespace stays behind
            raise

    # ---- TransferQueue calls ---------------------------------------------------------------

    def _tq(self, partition: str) -> str:
        return f"{self.namespace}/{partition}"

    def _own(self) -> builtins.list[str]:
        prefix = f"{self.namespace}/"
        listed = self._call("list partitions", self._client.get_partition_list)
        return sorted(p.removeprefix(prefix) for p in listed if p.startswith(prefix))

    def _tags(self, partition: str) -> dict[str, dict[str, Any]]:
        """Keys of rows whose put finished (a failed put leaves its keys registered, untagged)."""
        listed = self._call("list", lambda: self._client.kv_list(self._tq(partition)))
        return {k: tag for k, tag in listed.get(self._tq(partition), {}).items() if _valid(tag)}

    def _put_batch(self, partition: str, schema: _Schema, batch: _Rows) -> None:
        keys = list(batch)
        tags = [_tag(key, row) for key, row in batch.items()]
        fields = _columns(schema, list(batch.values())) if schema else None
        tq = tq_runtime.import_tq()
        self._call(
            "put",
            lambda: tq.kv_batch_put(
                keys=keys,
                partition_id=self._tq(partition),
                fields=fields,
                tags=tags,
                data_parser=clone_each_row if fields is not None else None,
            ),
        )

    def _meta(self, partition: str, keys: Sequence[str]) -> Any:
        """TransferQueue's metadata for ``keys``, after checking it is for exactly those keys
        with finished puts, in order; names every key that is not."""
        meta = self._call(
            "read metadata",
            lambda: self._client.kv_retrieve_meta(
                keys=list(keys), partition_id=self._tq(partition), create=False
            ),
        )
        tags = list(meta.custom_meta) if meta.size else []
        found = [tag.get("key") if _valid(tag) else None for tag in tags]
        if found != list(keys):
            missing = set(keys) - {key for key in found if key is not None}
            if missing:
                raise DataPlaneKeyMissing(partition, missing)
            raise DataPlaneUnavailable(
                f"TransferQueue answered {partition!r} keys {found[:5]}... for {list(keys)[:5]}..."
            )
        return meta

    def _get_batch(self, partition: str, keys: Sequence[str], meta: Any = None) -> _Rows:
        meta = meta if meta is not None else self._meta(partition, keys)
        groups: dict[_Schema, builtins.list[int]] = {}
        for position, tag in enumerate(meta.custom_meta):
            groups.setdefault(_tag_schema(tag), []).append(position)
        rows: _Rows = {}
        for schema, positions in groups.items():
            subset = [keys[p] for p in positions]
            # TransferQueue's metadata lists only the fields every requested row has.
            group_meta = meta if len(groups) == 1 else self._meta(partition, subset)
            tags = [meta.custom_meta[p] for p in positions]
            rows.update(self._read_group(partition, schema, subset, tags, group_meta))
        return rows

    def _read_group(
        self,
        partition: str,
        schema: _Schema,
        keys: Sequence[str],
        tags: Sequence[dict[str, Any]],
        meta: Any,
    ) -> _Rows:
        if not schema:
            return {key: {} for key in keys}
        fields = [field for field, _ in schema]
        names = [_column_name(field, dtype) for field, dtype in schema]
        # select_fields deep-copies the metadata (tags included): only when there is more.
        wanted = meta if sorted(meta.field_names) == sorted(names) else meta.select_fields(names)
        try:
            data = self._call("get", lambda: self._client.get_data(wanted))
        except DataPlaneUnavailable as exc:
            # Storage lost a key the controller still lists: for one key, that key is gone (for
            # several, TransferQueue does not say which: ReadBatcher reads them one by one).
            lost = tq_runtime.import_tq().StorageKeyNotFoundError
            if len(keys) == 1 and isinstance(exc.__cause__, lost):
                raise DataPlaneKeyMissing(partition, keys) from exc
            raise
        columns = {
            f: _split_column(data[name], len(keys)) for f, name in zip(fields, names, strict=True)
        }
        return {
            key: _decode_row(partition, key, tag, {f: columns[f][i] for f in fields})
            for i, (key, tag) in enumerate(zip(keys, tags, strict=True))
        }

    def _stream_rows(self, partition: str, keys: Sequence[str]) -> Iterator[tuple[str, Row]]:
        batches = [keys[i : i + BATCH_ROWS] for i in range(0, len(keys), BATCH_ROWS)]
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tq-export") as pool:
            ahead: Future[_Rows] | None = None
            for number, batch in enumerate(batches):
                rows = ahead.result() if ahead else self._get_batch(partition, batch)
                following = batches[number + 1] if number + 1 < len(batches) else None
                ahead = pool.submit(self._get_batch, partition, following) if following else None
                yield from ((key, rows[key]) for key in batch)

    def _require_empty(self) -> None:
        if held := self.partitions():
            raise InvalidInput(
                f"import_ needs an empty data plane; namespace {self.namespace!r} holds {held} "
                "(clear() it)"
            )

    @staticmethod
    def _call(operation: str, call: Any) -> Any:
        try:
            return call()
        except RollsafeError:
            raise
        except Exception as exc:  # TransferQueue raises RuntimeError/ValueError/its own
            raise DataPlaneUnavailable(
                f"TransferQueue {operation} failed: {type(exc).__name__}: {exc}"
            ) from exc


# -- rows <-> TransferQueue columns and tags ------------------------------------------------------


def _schema(row: Mapping[str, np.ndarray]) -> _Schema:
    return tuple(sorted((field, array.dtype.str) for field, array in row.items()))


def _tag(key: str, row: Mapping[str, np.ndarray]) -> dict[str, Any]:
    return {
        "rollsafe": TAG_VERSION,
        "key": key,
        "fields": {f: [a.dtype.str, list(a.shape)] for f, a in sorted(row.items())},
        "sha256": row_digest(row).hex(),
    }


def _column_name(field: str, dtype: str) -> str:
    return f"{field}:{dtype[1:]}"  # '<i8' -> 'i8': byte order is always little here


def _valid(tag: object) -> bool:
    return isinstance(tag, dict) and tag.get("rollsafe") == TAG_VERSION and "key" in tag


def _tag_schema(tag: Mapping[str, Any]) -> _Schema:
    return tuple(sorted((field, spec[0]) for field, spec in tag["fields"].items()))


def _columns(schema: _Schema, rows: Sequence[Mapping[str, np.ndarray]]) -> Any:
    """One jagged column per field: each row's array flattened (shapes live in the tags)."""
    import torch
    from tensordict import TensorDict

    columns: dict[str, Any] = {}
    with warnings.catch_warnings():
        # torch warns that a read-only array could be written through the tensor; nothing
        # writes: nested_tensor copies every row into its own buffer at once.
        warnings.simplefilter("ignore", UserWarning)
        for field, dtype in schema:
            flat = [torch.from_numpy(np.ascontiguousarray(row[field]).reshape(-1)) for row in rows]
            columns[_column_name(field, dtype)] = torch.nested.nested_tensor(
                flat, layout=torch.jagged
            )
    return TensorDict(columns, batch_size=[len(rows)])


def _split_column(column: Any, count: int) -> builtins.list[np.ndarray]:
    """Each row's flat array, sliced out of the column's one buffer in numpy: converting row
    by row through torch costs more than TransferQueue's own transfer."""
    if column.is_nested:
        values, offsets = column.values().numpy(), column.offsets().numpy().tolist()
    else:  # equal lengths may come back as one regular (count, n) tensor
        values = column.reshape(-1).numpy()
        width = values.size // count if count else 0
        offsets = [width * i for i in range(count + 1)]
    if len(offsets) != count + 1:
        raise DataPlaneUnavailable(
            f"TransferQueue returned {len(offsets) - 1} rows for {count} keys"
        )
    return [values[offsets[i] : offsets[i + 1]] for i in range(count)]


def _decode_row(
    partition: str, key: str, tag: Mapping[str, Any], columns: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    row: dict[str, np.ndarray] = {}
    for field, (dtype, shape) in tag["fields"].items():
        flat = columns[field]
        if flat.dtype.str != dtype or flat.size != math.prod(shape):
            raise DataPlaneCorrupt(
                f"{partition}/{key!r} field {field!r}: TransferQueue returned "
                f"{flat.dtype.str}[{flat.size}], the row was put as {dtype}{shape}"
            )
        array = flat.reshape(shape)
        array.setflags(write=False)
        row[field] = array
    if row_digest(row).hex() != tag["sha256"]:
        raise DataPlaneCorrupt(f"{partition}/{key!r}: row differs from the digest it was put with")
    return row
