"""A run's configuration as rollsafe sees it. Every default is defined here, once."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollsafe.core.ids import validate_run_id

SamplerName = Literal["windowed", "in_order", "weight_fifo"]
RestoreLevelName = Literal["prompt_group", "sibling", "turn", "prefix"]
DataplaneName = Literal["memory", "transferqueue"]

# Retention: the newest snapshots kept (besides those at the trainer's anchors).
KEEP_LATEST_K = 2
# The journal's group commit: a batch is written and synced at most this long after its first
# record (chosen from bench/journal_bench.py; docs/journal.md, "The loss window").
JOURNAL_FLUSH_MS = 5.0
# On object storage: how often the journal's open segment is closed and copied to the bucket
# (what a lost machine can cost; a crashed process loses nothing acknowledged).
JOURNAL_MIRROR_S = 10.0


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    group_size: int = Field(ge=1, le=1024)
    groups_per_step: int = Field(ge=1)
    sampler: SamplerName = "windowed"
    staleness_window: int = Field(default=1, ge=0)
    # The finest level a group may restore at; each group records its own at handout.
    restore_level: RestoreLevelName = "sibling"
    # Append every change to a durable journal between snapshots (docs/journal.md).
    journal: bool = True
    journal_flush_ms: float = Field(default=JOURNAL_FLUSH_MS, gt=0, le=10_000)

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        return validate_run_id(value)
