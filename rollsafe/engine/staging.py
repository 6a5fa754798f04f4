"""Prefix records in the data plane: staged by a cut, read back by a resume.

A record becomes one row of typed arrays (tokens, logprobs, weight versions, MoE routes) plus its
scalar fields as a small JSON array, so a million-token inventory is bytes, not JSON numbers.
Reading a row back rebuilds the record and verifies its digest: a row changed in storage is a
:class:`~rollsafe.errors.PrefixMismatch`, never a resume from the wrong tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

from rollsafe.dataplane import DataPlane
from rollsafe.dataplane.batcher import DEFAULT_MAX_ROWS, DEFAULT_WINDOW_S, ReadBatcher
from rollsafe.engine.protocol import CUT_BATCH, CutRefusal, Engine, PrefixRecord
from rollsafe.errors import PrefixMismatch

log = logging.getLogger(__name__)
PREFIX_PARTITION = "prefixes"
_SCALARS = ("format_version", "call_id", "model", "prompt_digest", "sampling", "digest")


def prefix_key(call_id: str) -> str:
    return f"prefix/{call_id}"


def record_to_row(record: PrefixRecord) -> dict[str, np.ndarray]:
    meta = record.model_dump(mode="json", include=set(_SCALARS))
    row: dict[str, np.ndarray] = {
        "meta": np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8),
        "tokens": np.asarray(record.tokens, dtype=np.int64),
        "logprobs": np.asarray(record.logprobs, dtype=np.float32),
        "weight_versions": np.asarray(record.weight_versions, dtype=np.int64),
    }
    if record.routes is not None:
        row["routes"] = np.asarray(record.routes, dtype=np.int16)
    return row


def row_to_record(key: str, row: dict[str, np.ndarray]) -> PrefixRecord:
    """The record a row holds, digest verified."""
    try:
        meta = json.loads(bytes(row["meta"]).decode())
        record = PrefixRecord.model_validate(
            {
                **meta,
                "tokens": row["tokens"].tolist(),
                "logprobs": row["logprobs"].tolist(),
                "weight_versions": row["weight_versions"].tolist(),
                "routes": row["routes"].tolist() if "routes" in row else None,
            }
        )
    except (KeyError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise PrefixMismatch(key.removeprefix("prefix/"), "row", f"unreadable row: {exc}") from exc
    record.verify()
    return record


def stage_prefixes(
    dataplane: DataPlane, records: Sequence[PrefixRecord], *, batch_size: int = CUT_BATCH
) -> list[str]:
    """Put ``records`` into the prefix partition, ``batch_size`` rows per put; their keys."""
    keys: list[str] = []
    for start in range(0, len(records), batch_size):
        batch = {
            prefix_key(r.call_id): record_to_row(r) for r in records[start : start + batch_size]
        }
        dataplane.put(PREFIX_PARTITION, batch)
        keys.extend(batch)
    return keys


class StagedCut(BaseModel):
    """What a cut left in the data plane, and which calls fall back to their turn."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    staged: dict[str, int]  # call id -> prefix tokens staged
    refused: tuple[CutRefusal, ...]
    handoffs: int
    # Not cut on purpose: their groups restore at a coarser level than ``prefix``.
    skipped: tuple[str, ...] = ()


async def cut_and_stage(engine: Engine, call_ids: Sequence[str], dataplane: DataPlane) -> StagedCut:
    """Freeze ``call_ids`` on ``engine`` and stage their prefixes (the cut_generation phase's
    work for one engine). A refused call is reported, not raised: it restarts from its turn.
    The calls stay frozen until :meth:`Engine.release` (resume phase) or the engine goes away."""
    report = await engine.cut(call_ids)
    stage_prefixes(dataplane, report.prefixes)
    return StagedCut(
        staged={p.call_id: len(p.tokens) for p in report.prefixes},
        refused=report.refused,
        handoffs=report.handoffs,
    )


def drop_staged(dataplane: DataPlane) -> None:
    """Every staged prefix leaves the live data plane: once a snapshot holds them (its capture
    exported them) or a restore handed them to the environments, the live copies are never
    read again, and kept they would be exported by every later capture. Best effort: a
    leftover costs bytes in later snapshots, never correctness, so it must not fail a phase."""
    try:
        dataplane.clear(PREFIX_PARTITION)
    except Exception as exc:
        log.warning("staged prefixes not dropped from the data plane: %s", exc)


def load_prefixes(dataplane: DataPlane, call_ids: Iterable[str]) -> dict[str, PrefixRecord]:
    """The staged records of ``call_ids`` (one multi-key read), each verified.

    A call with no staged row fails the read with its key named
    (:class:`~rollsafe.errors.DataPlaneKeyMissing`)."""
    keys = [prefix_key(c) for c in call_ids]
    rows = dataplane.get(PREFIX_PARTITION, keys)
    return {
        rows_key.removeprefix("prefix/"): row_to_record(rows_key, row)
        for rows_key, row in rows.items()
    }


class PrefixReader:
    """Staged records read one call at a time by many concurrent resumers, coalesced into
    multi-key reads (:class:`~rollsafe.dataplane.batcher.ReadBatcher`): a restore that resumes
    N calls pays about N / 256 data-plane reads, and each resumer gets its own record or its
    own error."""

    def __init__(
        self,
        dataplane: DataPlane,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        max_rows: int = DEFAULT_MAX_ROWS,
    ) -> None:
        self.batcher = ReadBatcher(
            dataplane, PREFIX_PARTITION, window_s=window_s, max_rows=max_rows
        )

    async def read(self, call_id: str) -> PrefixRecord:
        key = prefix_key(call_id)
        return row_to_record(key, await self.batcher.read(key))
