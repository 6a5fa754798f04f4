"""A workplace episode's whole state at a turn boundary: what ``export_episode`` writes and
``restore_episode`` reads back (format ``workplace/1``).

A live episode's state *is* this record (immutable, replaced as the episode advances), so an
export is a dump and nothing the episode holds can be left out of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollsafe.engine.protocol import GenerateRequest
from rollsafe.env.protocol import EpisodeRef
from rollsafe.errors import InvalidInput
from rollsafe.reference.envs.workplace.calendar import Calendar, Task, describe

FORMAT: Literal["workplace/1"] = "workplace/1"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InFlight(_Frozen):
    """The policy call the episode is waiting on: re-issued exactly after a restore."""

    call_id: str
    request: GenerateRequest

    @model_validator(mode="after")
    def _same_call(self) -> InFlight:
        if self.request.call_id != self.call_id:
            raise ValueError(f"request is for call {self.request.call_id!r}, not {self.call_id!r}")
        return self


class TurnLog(_Frozen):
    """What the policy generated for one completed turn."""

    turn: int = Field(ge=0)
    call_id: str
    tokens: tuple[int, ...]
    resumed_from: int = Field(
        default=0, ge=0, description="tokens taken from a cut's prefix record (not regenerated)"
    )


class EpisodeRecord(_Frozen):
    format: Literal["workplace/1"] = FORMAT
    episode: EpisodeRef = Field(description="the attempt this state belongs to")
    task: Task
    turn: int = Field(ge=0, description="turns completed")
    calendar: Calendar
    history: tuple[TurnLog, ...] = ()
    in_flight: InFlight | None = None

    @model_validator(mode="after")
    def _consistent(self) -> EpisodeRecord:
        if self.turn > self.task.turns:
            raise ValueError(f"turn {self.turn} is past the task's {self.task.turns} turns")
        if len(self.history) != self.turn or len(self.calendar.mutations) != self.turn:
            raise ValueError(
                f"{self.turn} turns completed but {len(self.history)} history entries and "
                f"{len(self.calendar.mutations)} mutations"
            )
        if self.in_flight is not None and self.turn == self.task.turns:
            raise ValueError("a finished episode has no call in flight")
        return self


def parse_record(raw: Mapping[str, Any]) -> EpisodeRecord:
    try:
        return EpisodeRecord.model_validate(dict(raw))
    except ValidationError as exc:
        raise InvalidInput(f"bad workplace record: {describe(exc)}") from None
