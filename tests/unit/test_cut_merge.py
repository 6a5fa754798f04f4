"""The cut phase merges every engine's answer in one pass (rollsafe.checkpoint.participants)."""

from __future__ import annotations

from rollsafe.checkpoint.participants import merge_cuts
from rollsafe.engine.protocol import CutRefusal
from rollsafe.engine.staging import StagedCut


def cut(staged: dict[str, int], **reasons: str) -> StagedCut:
    refused = tuple(CutRefusal(call_id=c, reason=r) for c, r in reasons.items())  # type: ignore[arg-type]
    return StagedCut(staged=staged, refused=refused, handoffs=1)


def test_the_engine_that_held_a_call_is_believed_over_those_that_did_not() -> None:
    a = cut({"x": 4}, y="finished", z="not_admitted", w="not_admitted", v="no_tokens")
    b = cut(
        {}, x="not_admitted", y="not_admitted", z="not_admitted", w="abandoned", v="unknown_call"
    )
    merged = merge_cuts(["x", "y", "z", "w", "v"], [a, b])
    assert merged.staged == {"x": 4}
    assert {r.call_id: r.reason for r in merged.refused} == {
        "y": "finished",
        "z": "not_admitted",
        "w": "abandoned",
        "v": "no_tokens",
    }
    assert [r.call_id for r in merged.refused] == ["y", "z", "w", "v"]  # in the calls' order
    assert merged.handoffs == 2


def test_no_engine_leaves_every_call_unknown() -> None:
    merged = merge_cuts(["x"], [])
    assert [(r.call_id, r.reason) for r in merged.refused] == [("x", "unknown_call")]
