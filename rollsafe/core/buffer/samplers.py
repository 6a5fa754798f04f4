"""Samplers: which ready groups a training step takes next. One protocol, three policies.

- ``windowed``: any READY group whose weight lag (current version - start version) is within
  ``staleness_window``, oldest dataset index first. Groups outside the window are never
  picked; dropping them (``evict``) is the run's call, not the sampler's or the checkpoint's.
- ``in_order``: strictly in dataset order: the next ``count`` unclaimed owned groups by index
  must all be READY, else the step waits.
- ``weight_fifo``: strictly oldest start weight first (ties by index), gated the same way.

The gated samplers ignore ``staleness_window``: a group at the head of their order is trained
however old it is, because skipping it would break the order they promise.

Every sampler keeps its own state (what it has fed to committed steps; ``in_order`` also the
dataset index below which everything is trained or evicted) and saves/restores it with the
snapshot. A sampler returns ``[]`` when it would wait; it never returns a short step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from rollsafe.core.buffer.index import ReplayIndex
from rollsafe.core.states import GroupState
from rollsafe.errors import InvalidInput, SnapshotCorrupt


class SamplerState(BaseModel):
    """What a sampler saves. ``cursor`` is used by ``in_order`` only."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = 1
    name: str
    steps_committed: int = Field(default=0, ge=0)
    groups_committed: int = Field(default=0, ge=0)
    cursor: int = Field(default=0, ge=0)


class Sampler(ABC):
    name: ClassVar[str]

    def __init__(self, staleness_window: int = 1) -> None:
        if staleness_window < 0:
            raise InvalidInput(f"staleness_window must be >= 0, got {staleness_window}")
        self.staleness_window = staleness_window
        self._state = SamplerState(name=self.name)

    @abstractmethod
    def select(self, index: ReplayIndex, weight_version: int, count: int) -> list[int]:
        """Groups for the next step, or [] to wait for more."""

    def stale(self, index: ReplayIndex, weight_version: int) -> list[int]:
        """Ready groups this sampler will never pick (the run may evict them). None here: the
        gated samplers train a group however old it is."""
        return []

    def committed(self, index: ReplayIndex, groups: Sequence[int]) -> None:
        """A step that trained ``groups`` committed (call after the index dropped them)."""
        self._state.steps_committed += 1
        self._state.groups_committed += len(groups)

    def state(self) -> SamplerState:
        return self._state.model_copy()

    def load_state(self, state: SamplerState, index: ReplayIndex) -> None:
        if state.name != self.name:
            raise InvalidInput(
                f"the snapshot was taken with sampler {state.name!r}; this run is configured "
                f"with {self.name!r}"
            )
        if state.format_version != 1:
            raise SnapshotCorrupt(f"unknown sampler state format_version {state.format_version}")
        self._state = state.model_copy()

    @staticmethod
    def _gated(order: list[tuple[int, GroupState]], count: int) -> list[int]:
        head = [(idx, state) for idx, state in order if state != GroupState.CLAIMED][:count]
        if len(head) < count or any(state != GroupState.READY for _, state in head):
            return []
        return [idx for idx, _ in head]


class WindowedSampler(Sampler):
    name = "windowed"

    def select(self, index: ReplayIndex, weight_version: int, count: int) -> list[int]:
        eligible = [
            idx
            for idx, state, start in index.rows()
            if state == GroupState.READY and self._fresh(weight_version, start)
        ]
        return eligible[:count] if len(eligible) >= count else []

    def stale(self, index: ReplayIndex, weight_version: int) -> list[int]:
        return [
            idx
            for idx, state, start in index.rows()
            if state == GroupState.READY and not self._fresh(weight_version, start)
        ]

    def _fresh(self, weight_version: int, start_version: int) -> bool:
        return weight_version - start_version <= self.staleness_window


class InOrderSampler(Sampler):
    name = "in_order"

    def select(self, index: ReplayIndex, weight_version: int, count: int) -> list[int]:
        return self._gated([(idx, state) for idx, state, _ in index.rows()], count)

    def committed(self, index: ReplayIndex, groups: Sequence[int]) -> None:
        super().committed(index, groups)
        owned = index.groups()
        # Everything below the lowest owned index is trained or evicted; with nothing owned,
        # everything up to the highest index it has seen is.
        self._state.cursor = owned[0] if owned else max(self._state.cursor, max(groups) + 1)

    def load_state(self, state: SamplerState, index: ReplayIndex) -> None:
        owned = index.groups()
        if owned and owned[0] < state.cursor:
            raise SnapshotCorrupt(
                f"in_order sampler cursor {state.cursor} is past owned group {owned[0]}"
            )
        super().load_state(state, index)


class WeightFifoSampler(Sampler):
    name = "weight_fifo"

    def select(self, index: ReplayIndex, weight_version: int, count: int) -> list[int]:
        rows = sorted(index.rows(), key=lambda row: (row[2], row[0]))
        return self._gated([(idx, state) for idx, state, _ in rows], count)


SAMPLERS: dict[str, type[Sampler]] = {
    cls.name: cls for cls in (WindowedSampler, InOrderSampler, WeightFifoSampler)
}


def make_sampler(name: str, staleness_window: int = 1) -> Sampler:
    try:
        return SAMPLERS[name](staleness_window)
    except KeyError:
        raise InvalidInput(
            f"unknown sampler {name!r} (choose from {', '.join(sorted(SAMPLERS))})"
        ) from None
