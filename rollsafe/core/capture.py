"""A controller's state as captured for a snapshot (everything but the data plane's rows);
its files are written and read by rollsafe.snapshot.state_files.

Capturing takes read-only views of numpy columns (copied on the run's next write, not in the
park window: rollsafe.core.columns); ordering them by key, checking that the ledger, the replay
index and the data plane agree, and writing all happen after the run resumed, on those views,
with no Python loop over rollouts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, NonNegativeInt, model_validator

from rollsafe.core.buffer import SamplerState
from rollsafe.core.columns import KEY_COLUMN, in_key_order
from rollsafe.core.config import RunConfig
from rollsafe.core.ids import rollout_key
from rollsafe.core.states import AttemptState, GroupState
from rollsafe.errors import LedgerInvariantViolation

Columns = tuple[dict[str, np.ndarray], dict[str, str]]  # arrays, string metadata


class LoaderState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format_version: Literal[1, 2] = 2
    position: NonNegativeInt
    weight_version: NonNegativeInt
    # Groups handed out since the run began (format 2; 1 is an earlier rollsafe's, without):
    # each is owned (in the replay index), trained or evicted, so the loader and the index of
    # one capture agree on it, and those of two captures, put together, do not.
    handed_out: NonNegativeInt | None = None

    @model_validator(mode="after")
    def _fields_of_its_version(self) -> LoaderState:
        if (self.handed_out is None) != (self.format_version == 1):
            raise ValueError("handed_out is a field of format_version 2, and only of it")
        return self


@dataclass(frozen=True)
class CapturedState:
    ledger: Columns
    index: Columns
    loader: LoaderState
    sampler: SamplerState
    config: RunConfig

    def counts(self) -> dict[str, int]:
        retirements = len(json.loads(self.ledger[1]["retire"]))
        return {
            "groups": len(self.index[0][KEY_COLUMN]),
            "claimed_groups": int((self.index[0]["state"] == int(GroupState.CLAIMED)).sum()),
            "retirements": retirements,
        }

    def in_key_order(self) -> CapturedState:
        """The same state with its columns sorted by key, as files hold them."""
        ledger, index = self.ledger, self.index
        return replace(
            self,
            ledger=(in_key_order(ledger[0]), ledger[1]),
            index=(in_key_order(index[0]), index[1]),
        )

    def sealed(self) -> int:
        """How many rollouts the captured ledger holds sealed (no data plane call)."""
        return int(np.count_nonzero(self.ledger[0]["state"] == int(AttemptState.SEALED)))

    def sealed_keys(self) -> list[str]:
        """The data-plane key of every sealed rollout in the captured ledger."""
        ledger = self.ledger[0]
        rows, siblings = np.nonzero(ledger["state"] == int(AttemptState.SEALED))
        groups = ledger[KEY_COLUMN][rows].tolist()
        run = self.config.run_id
        return [rollout_key(run, idx, i) for idx, i in zip(groups, siblings.tolist(), strict=True)]


def check_agreement(state: CapturedState, rows: int) -> int:
    """The ledger and the index (both in key order: :meth:`CapturedState.in_key_order`)
    describe the same groups with the same sealed counts, and the data plane holds one row per
    sealed rollout. Returns the number of sealed rollouts."""
    ledger, index = state.ledger[0], state.index[0]
    if not np.array_equal(ledger[KEY_COLUMN], index[KEY_COLUMN]):
        only_ledger = np.setdiff1d(ledger[KEY_COLUMN], index[KEY_COLUMN])[:10].tolist()
        only_index = np.setdiff1d(index[KEY_COLUMN], ledger[KEY_COLUMN])[:10].tolist()
        raise LedgerInvariantViolation(
            f"ledger and replay index disagree: only in ledger {only_ledger}, "
            f"only in index {only_index}"
        )
    sealed = np.count_nonzero(ledger["state"] == int(AttemptState.SEALED), axis=1)
    differ = np.flatnonzero(sealed != index["sealed"])
    if differ.size:
        at = int(differ[0])
        raise LedgerInvariantViolation(
            f"group {int(index[KEY_COLUMN][at])}: ledger has {int(sealed[at])} sealed "
            f"rollouts, index {int(index['sealed'][at])}"
        )
    total = int(sealed.sum())
    if rows != total:
        raise LedgerInvariantViolation(
            f"data plane holds {rows} rollout rows but {total} are sealed"
        )
    _check_loader(state)
    return total


def _check_loader(state: CapturedState) -> None:
    """The loader handed out every group the index holds, and (format 2) as many groups as the
    index holds, trained and evicted: a loader and an index of two different captures are
    refused, naming both counts, before their groups go missing or are handed out twice."""
    loader, keys = state.loader, state.index[0][KEY_COLUMN]
    if keys.size and int(keys.max()) >= loader.position:
        raise LedgerInvariantViolation(
            f"the replay index holds group {int(keys.max())}, at or above the loader position "
            f"{loader.position}: the loader never handed it out"
        )
    metadata = state.index[1]
    accounted = keys.size + int(metadata["trained_total"]) + int(metadata["evicted_total"])
    if loader.handed_out is not None and loader.handed_out != accounted:
        raise LedgerInvariantViolation(
            f"the loader handed out {loader.handed_out} groups; the replay index accounts for "
            f"{accounted} ({keys.size} owned, {metadata['trained_total']} trained, "
            f"{metadata['evicted_total']} evicted)"
        )
