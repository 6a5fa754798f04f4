"""The replay index: every group the run owns, by dataset index.

A group enters at handout (RESERVED), starts generating at its first dispatch (GENERATING,
stamped with the weight version it starts under), becomes READY when all its rollouts are
sealed, may be CLAIMED by a step whose optimizer has not committed, and leaves the index when
a committed step TRAINED it or the sampler EVICTED it on purpose. What the index holds is
therefore exactly what the run owes: invariant 1 is "the restored index equals the captured
one, claims released".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from rollsafe.core.columns import Column, ColumnTable, check_metadata, format_metadata
from rollsafe.core.states import GroupState, check_group
from rollsafe.errors import InvalidInput, SnapshotCorrupt, UnknownGroup

FORMAT = "rollsafe.replay_index"
NO_STEP = -1
_READY = int(GroupState.READY)
_CLAIMED = int(GroupState.CLAIMED)

_SPEC = {
    "state": Column(np.dtype(np.uint8)),
    "start_version": Column(np.dtype(np.int64)),
    "sealed": Column(np.dtype(np.int32)),
    "claim_step": Column(np.dtype(np.int64), default=NO_STEP),
}


class ReplayIndex:
    def __init__(self, group_size: int) -> None:
        if group_size < 1:
            raise InvalidInput(f"group_size must be >= 1, got {group_size}")
        self.group_size = group_size
        self._table = ColumnTable(_SPEC)
        self.trained_total = 0
        self.evicted_total = 0

    def __contains__(self, idx: int) -> bool:
        return idx in self._table

    def __len__(self) -> int:
        return len(self._table)

    def _slot(self, idx: int) -> int:
        try:
            return self._table.slot(idx)
        except KeyError:
            raise UnknownGroup(
                f"group {idx} is not owned by the run (never handed out, trained or evicted)"
            ) from None

    def state(self, idx: int) -> GroupState:
        return GroupState(int(self._table.live("state")[self._slot(idx)]))

    def start_version(self, idx: int) -> int:
        return int(self._table.live("start_version")[self._slot(idx)])

    def sealed(self, idx: int) -> int:
        return int(self._table.live("sealed")[self._slot(idx)])

    def claim_step(self, idx: int) -> int | None:
        step = int(self._table.live("claim_step")[self._slot(idx)])
        return None if step == NO_STEP else step

    def groups(self) -> list[int]:
        """Every owned group, in dataset order."""
        return sorted(self._table)

    def in_states(self, *states: GroupState) -> list[int]:
        mask = np.isin(self._table.live("state"), [int(s) for s in states])
        return sorted(self._table.keys_array()[mask].tolist())

    def rows(self) -> list[tuple[int, GroupState, int]]:
        """``(idx, state, start_version)`` for every owned group, in dataset order."""
        keys = self._table.keys_array()
        order = np.argsort(keys, kind="stable")
        states = self._table.live("state")[order].tolist()
        versions = self._table.live("start_version")[order].tolist()
        return [
            (idx, GroupState(s), v)
            for idx, s, v in zip(keys[order].tolist(), states, versions, strict=True)
        ]

    # ---- transitions ----------------------------------------------------------------------

    def _move(self, idx: int, target: GroupState, operation: str) -> int:
        slot = self._slot(idx)
        states = self._table.column("state")
        check_group(f"group {idx}", operation, int(states[slot]), target)
        states[slot] = int(target)
        return slot

    def reserve(self, idx: int, weight_version: int) -> None:
        if idx in self._table:
            raise InvalidInput(f"group {idx} is already owned by the run")
        slot = self._table.add(idx)
        self._table.column("start_version")[slot] = weight_version

    def start(self, idx: int, weight_version: int) -> None:
        """First dispatch of any sibling: the group starts generating under this version."""
        if self.state(idx) != GroupState.RESERVED:
            return
        slot = self._move(idx, GroupState.GENERATING, "start")
        self._table.column("start_version")[slot] = weight_version

    def set_sealed(self, idx: int, sealed: int) -> None:
        """Record how many siblings are sealed; the last seal makes the group READY."""
        if not 0 <= sealed <= self.group_size:
            raise InvalidInput(f"group {idx}: sealed count {sealed} outside 0..{self.group_size}")
        slot = self._slot(idx)
        self._table.column("sealed")[slot] = sealed
        if sealed == self.group_size and self.state(idx) != GroupState.READY:
            self._move(idx, GroupState.READY, "seal")

    def claim(self, groups: Iterable[int], step: int) -> None:
        groups = list(groups)
        for idx in groups:  # check all first: a claim takes all or none
            check_group(f"group {idx}", "claim", int(self.state(idx)), GroupState.CLAIMED)
        for idx in groups:
            slot = self._move(idx, GroupState.CLAIMED, "claim")
            self._table.column("claim_step")[slot] = step

    def release_claims(self) -> list[int]:
        """Claims of a step that never committed come back READY."""
        released = self.in_states(GroupState.CLAIMED)
        for idx in released:
            slot = self._move(idx, GroupState.READY, "release claim")
            self._table.column("claim_step")[slot] = NO_STEP
        return released

    def train(self, groups: Iterable[int]) -> None:
        """A committed optimizer step trained these groups: they leave the run."""
        groups = list(groups)
        for idx in groups:
            check_group(f"group {idx}", "train", int(self.state(idx)), GroupState.TRAINED)
        for idx in groups:
            self._table.remove(idx)
        self.trained_total += len(groups)

    def evict(self, idx: int) -> None:
        """The sampler dropped this group on purpose: it is not owed back."""
        check_group(f"group {idx}", "evict", int(self.state(idx)), GroupState.EVICTED)
        self._table.remove(idx)
        self.evicted_total += 1

    # ---- capture and restore --------------------------------------------------------------

    def capture(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        metadata = {
            **format_metadata(FORMAT),
            "group_size": str(self.group_size),
            "trained_total": str(self.trained_total),
            "evicted_total": str(self.evicted_total),
        }
        return self._table.capture(), metadata

    @classmethod
    def restore(
        cls, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str], source: str
    ) -> ReplayIndex:
        check_metadata(metadata, FORMAT, {"group_size", "trained_total", "evicted_total"}, source)
        try:
            index = cls(int(metadata["group_size"]))
            index.trained_total = int(metadata["trained_total"])
            index.evicted_total = int(metadata["evicted_total"])
        except (ValueError, InvalidInput) as exc:
            raise SnapshotCorrupt(f"{source}: bad replay index metadata ({exc})") from None
        index._table = ColumnTable.from_capture(_SPEC, arrays, source)
        states = index._table.live("state")
        if states.size and int(states.max()) > _CLAIMED:
            raise SnapshotCorrupt(f"{source}: a terminal or unknown group state is stored")
        sealed = index._table.live("sealed")
        ready = np.isin(states, [_READY, _CLAIMED])
        if ((sealed < 0) | (sealed > index.group_size)).any() or (
            ready != (sealed == index.group_size)
        ).any():
            raise SnapshotCorrupt(f"{source}: sealed counts disagree with group states")
        return index
