"""The evidence a run leaves in its ``--out`` directory, read by ``rollsafe verify`` and by
external checkers (the formats are fixed: changing one breaks them).

One JSON object per line, fields exactly as below (unknown fields are refused)::

    trained_rows.jsonl     a row of a committed optimizer step in the final weights' lineage
    rolled_back_rows.jsonl the same, for steps a restore undid (optional)
    handed_out.jsonl       a group the loader handed out, over the whole run, across restores
    env_mutations.jsonl    the reference environment's final state: one applied mutation each
    faults.jsonl           each injected fault, when, and how it was recovered
    generations.jsonl      each attempt's generation started and sealed, and each whole-run
                           kill, with their times (optional: the reference run writes it)
    report.json            the run's settings and totals (one object)

Reading names the file and line of anything malformed; writing appends a line and flushes, so
a run killed on purpose leaves every line it wrote whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollsafe.errors import EvidenceError

SHA256 = r"^[0-9a-f]{64}$"


class JsonLine(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TrainedRow(JsonLine):
    step: int = Field(ge=0)
    group_idx: int = Field(ge=0)
    rollout_id: str = Field(min_length=1)
    attempt: int = Field(ge=0)
    n_tokens: int = Field(ge=0)
    tokens_sha256: str = Field(pattern=SHA256)
    restored_prefix_tokens: int = Field(ge=0)


class HandedOut(JsonLine):
    group_idx: int = Field(ge=0)
    group_id: str = Field(min_length=1)
    status: Literal["trained", "evicted", "owed"]


class EnvMutation(JsonLine):
    instance: str = Field(min_length=1)
    rollout_id: str = Field(min_length=1)
    turn: int = Field(ge=0)
    call_id: str = Field(min_length=1)


class FaultRecord(JsonLine):
    kind: str = Field(description="coordinator | run | env")
    where: str = Field(description="the phase, step or operation it hit")
    at_s: float = Field(ge=0, description="seconds since the run started")
    recovered: str = Field(description="how the run recovered, in words")
    recovery_s: float | None = Field(default=None, ge=0)


class GenerationEvent(JsonLine):
    """An attempt's generation started or sealed (its seal acknowledged), or the whole run
    killed (``rollout_id`` and ``attempt`` only for the first two)."""

    event: Literal["started", "sealed", "killed"]
    rollout_id: str | None = Field(default=None, min_length=1)
    attempt: int | None = Field(default=None, ge=0)
    at_unix: float = Field(ge=0, description="seconds since the epoch")

    @model_validator(mode="after")
    def _names_its_attempt(self) -> GenerationEvent:
        if (self.event == "killed") != (self.rollout_id is None or self.attempt is None):
            raise ValueError("started and sealed name rollout_id and attempt; killed neither")
        return self


class RunReport(JsonLine):
    run_id: str
    seed: int
    steps: int = Field(ge=0)
    group_size: int = Field(ge=1)
    groups_per_step: int = Field(ge=1)
    sampler: str
    restore_level: str
    deterministic: bool
    totals: dict[str, float] = Field(default_factory=dict)
    # The run kept a journal between snapshots (docs/journal.md): no sealed rollout may be
    # generated twice. Absent in reports written before the journal: false.
    journal: bool = False


TRAINED, ROLLED_BACK, HANDED_OUT = (
    "trained_rows.jsonl",
    "rolled_back_rows.jsonl",
    "handed_out.jsonl",
)
MUTATIONS, FAULTS, REPORT = "env_mutations.jsonl", "faults.jsonl", "report.json"
GENERATIONS = "generations.jsonl"

Line = TypeVar("Line", bound=JsonLine)


class Evidence(BaseModel):
    """Everything ``rollsafe verify`` reads from one run's directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    report: RunReport
    trained: tuple[TrainedRow, ...]
    rolled_back: tuple[TrainedRow, ...]
    handed_out: tuple[HandedOut, ...]
    mutations: tuple[EnvMutation, ...]
    faults: tuple[FaultRecord, ...]
    generations: tuple[GenerationEvent, ...] = ()

    @classmethod
    def read(cls, directory: Path) -> Evidence:
        directory = Path(directory)
        if not directory.is_dir():
            raise EvidenceError(f"{directory}: no such evidence directory")
        return cls(
            report=_read_report(directory / REPORT),
            trained=tuple(read_lines(directory / TRAINED, TrainedRow)),
            rolled_back=tuple(read_lines(directory / ROLLED_BACK, TrainedRow, optional=True)),
            handed_out=tuple(read_lines(directory / HANDED_OUT, HandedOut)),
            mutations=tuple(read_lines(directory / MUTATIONS, EnvMutation)),
            faults=tuple(read_lines(directory / FAULTS, FaultRecord)),
            generations=tuple(read_lines(directory / GENERATIONS, GenerationEvent, optional=True)),
        )


def read_lines(path: Path, model: type[Line], *, optional: bool = False) -> list[Line]:
    if not path.exists():
        if optional:
            return []
        raise EvidenceError(f"{path}: missing")
    lines: list[Line] = []
    with open(path, encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                lines.append(model.model_validate_json(text))
            except ValidationError as exc:
                problem = exc.errors()[0]
                where = ".".join(str(part) for part in problem["loc"]) or "(line)"
                raise EvidenceError(f"{path}:{number}: {where}: {problem['msg']}") from None
    return lines


def _read_report(path: Path) -> RunReport:
    if not path.exists():
        raise EvidenceError(f"{path}: missing")
    try:
        return RunReport.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise EvidenceError(
            f"{path}: {exc.errors()[0]['msg']} at {exc.errors()[0]['loc']}"
        ) from None


def append_lines(path: Path, lines: Iterable[JsonLine]) -> None:
    """One JSON object a line, flushed: a killed writer leaves whole lines behind."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.writelines(line.model_dump_json() + "\n" for line in lines)
        handle.flush()


def replace_lines(path: Path, lines: Iterable[JsonLine]) -> None:
    """``path`` holding exactly ``lines``, replaced whole (temporary file, then rename)."""
    _replace(path, "".join(line.model_dump_json() + "\n" for line in lines))


def write_report(path: Path, report: RunReport) -> None:
    _replace(path, json.dumps(report.model_dump(mode="json"), indent=2) + "\n")


def _replace(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)
