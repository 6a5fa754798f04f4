"""How the run reads an environment fleet's refusals in a snapshot's phases: instances that
resumed a checkpoint (an earlier prepare failed, or their park lease ran out before the
commit) refuse its id forever; the snapshot is spent, not the run's snapshots."""

from __future__ import annotations

import pytest

from rollsafe.checkpoint.phases.context import spent_if_resumed
from rollsafe.errors import CheckpointSpent, EnvRefused

CID = "run.rollout.00000001"


def refusal(reason: str) -> EnvRefused:
    return EnvRefused("http://w0", "commit", reason, f"{CID} was resumed or expired")


def test_a_resumed_checkpoint_is_spent_and_transient() -> None:
    with pytest.raises(CheckpointSpent) as info, spent_if_resumed(CID, "the lease ran out"):
        raise refusal("checkpoint_resumed")
    assert info.value.transient
    assert f"{CID}: the instances resumed it (the lease ran out)" in str(info.value)
    assert isinstance(info.value.__cause__, EnvRefused)


@pytest.mark.parametrize("reason", ["retired", "wrong_phase", "other_checkpoint"])
def test_other_refusals_pass_through(reason: str) -> None:
    with pytest.raises(EnvRefused) as info, spent_if_resumed(CID, "why"):
        raise refusal(reason)
    assert info.value.reason == reason and not info.value.transient
