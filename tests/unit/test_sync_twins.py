"""The synchronous SDK mirrors its asynchronous twin by hand (rollsafe.client's
SyncCheckpointer, rollsafe.rollouts' SyncRollouts, rollsafe.source's SyncRolloutSource): every
public call of the twin is there, with the same parameters (names, kinds, defaults), a coroutine
becoming a blocking call."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from rollsafe.client import Checkpointer, SyncCheckpointer
from rollsafe.rollouts import Rollouts, SyncRollouts
from rollsafe.source import RolloutSource, SyncRolloutSource

TWINS = [
    (Checkpointer, SyncCheckpointer),
    (Rollouts, SyncRollouts),
    (RolloutSource, SyncRolloutSource),
]
# The synchronous side's own: it owns an event loop thread the asynchronous one does not (the
# source's twin closes the source's, and its own loop with it).
SYNC_ONLY = {Checkpointer: {"close"}, Rollouts: {"close"}, RolloutSource: set()}
# The twin's instance attributes (set in its __init__), read through properties here.
ATTRIBUTES = {
    Checkpointer: {"run_id", "saved_checkpoints"},
    Rollouts: set(),
    RolloutSource: {"plan"},
}


def public(cls: type) -> dict[str, Any]:
    """Public methods and properties (tunables, plain class attributes, are set on the
    wrapped twin: ``sync.checkpointer.worker_timeout_s = ...``)."""
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    }


def parameters(member: Any) -> list[tuple[str, Any, Any]]:
    function = member.fget if isinstance(member, property) else member
    assert function is not None
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize(("twin", "sync"), TWINS, ids=lambda cls: cls.__name__)
def test_every_public_call_has_its_twin_with_the_same_parameters(
    twin: type[Any], sync: type
) -> None:
    theirs, mine = public(twin), public(sync)
    attributes = ATTRIBUTES[twin]
    assert sorted(set(theirs)) == sorted(set(mine) - SYNC_ONLY[twin] - attributes)
    source = inspect.getsource(twin.__init__)
    for name in attributes:
        assert f"self.{name}" in source and isinstance(mine[name], property), name
    for name, member in theirs.items():
        assert isinstance(mine[name], property) == isinstance(member, property), name
        assert parameters(mine[name]) == parameters(member), name
        if inspect.iscoroutinefunction(member):
            assert not inspect.iscoroutinefunction(mine[name]), f"{name} must block"
