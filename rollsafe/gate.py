"""The admission gate: the switch that lets new episodes be dispatched (DESIGN.md section 5).

A checkpoint closes it (phase ``close_admission``) and reopens it (phase ``resume``, which
runs on every exit path). At most one checkpoint holds it closed at a time, and only the
holder can reopen it, so a late ``resume`` of an old checkpoint never reopens the gate under
a newer one. Both operations are idempotent per checkpoint id because Temporal runs
activities at least once.

A dispatch passes the gate inside :meth:`AdmissionGate.admission`, which holds the gate's
lock while the caller marks the attempt DISPATCHED: once ``close`` returns, every attempt
that got through is already recorded, and none is left "waiting at the gate" half-counted.
Pure and thread-safe; no I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from rollsafe.errors import InvalidInput


class GateHeld(InvalidInput):
    """A checkpoint tried to close the gate while another checkpoint holds it closed."""

    def __init__(self, holder: str, requester: str) -> None:
        self.holder = holder
        self.requester = requester
        super().__init__(
            f"admission gate is held closed by checkpoint {holder!r}; checkpoint "
            f"{requester!r} cannot close it until {holder!r} resumes"
        )


@dataclass(frozen=True)
class GateChange:
    """What a close or open did: ``changed`` is False for an idempotent repeat or a no-op,
    and ``detail`` says which, in words an operator can read."""

    changed: bool
    detail: str


class GateCounters(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    closes: int  # effective closes (repeats by the holder are not counted)
    opens: int  # effective reopens
    admitted: int
    refused: int


class AdmissionGate:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: str | None = None
        self._closes = 0
        self._opens = 0
        self._admitted = 0
        self._refused = 0

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._holder is None

    @property
    def holder(self) -> str | None:
        """The checkpoint holding the gate closed, or None when it is open."""
        with self._lock:
            return self._holder

    def close(self, checkpoint_id: str) -> GateChange:
        _check_id(checkpoint_id)
        with self._lock:
            if self._holder == checkpoint_id:
                return GateChange(False, f"already closed by {checkpoint_id}")
            if self._holder is not None:
                raise GateHeld(self._holder, checkpoint_id)
            self._holder = checkpoint_id
            self._closes += 1
            return GateChange(True, f"closed by {checkpoint_id}")

    def open(self, checkpoint_id: str) -> GateChange:
        """Reopen the gate if ``checkpoint_id`` holds it; otherwise a no-op that says why."""
        _check_id(checkpoint_id)
        with self._lock:
            if self._holder == checkpoint_id:
                self._holder = None
                self._opens += 1
                return GateChange(True, f"reopened by {checkpoint_id}")
            if self._holder is None:
                return GateChange(False, f"already open; {checkpoint_id} did not hold it")
            return GateChange(False, f"held by {self._holder}, not {checkpoint_id}: left closed")

    @contextmanager
    def admission(self) -> Iterator[bool]:
        """Yield whether a dispatch may pass, holding the gate's lock for the block so the
        caller records the dispatch before any ``close`` can complete. Keep the block short:
        ``close`` waits for it."""
        with self._lock:
            admitted = self._holder is None
            if admitted:
                self._admitted += 1
            else:
                self._refused += 1
            yield admitted

    def admit(self) -> bool:
        """Check the gate for one dispatch (when nothing needs recording atomically with it)."""
        with self.admission() as admitted:
            return admitted

    def counters(self) -> GateCounters:
        with self._lock:
            return GateCounters(
                closes=self._closes,
                opens=self._opens,
                admitted=self._admitted,
                refused=self._refused,
            )


def _check_id(checkpoint_id: str) -> None:
    if not isinstance(checkpoint_id, str) or not checkpoint_id:
        raise InvalidInput(f"invalid checkpoint id {checkpoint_id!r}")
