"""How env-check compares a restored attempt with the uninterrupted one (pure): info paths an
environment declares as the attempt's (``attempt_info``) are left out, the rest still counts;
a malformed declaration is named; the declarations travel in the audit only when made (a
dispatcher of an earlier release reads an audit without them)."""

from __future__ import annotations

from typing import Any

import pytest

from rollsafe.env import protocol as w
from rollsafe.env.conformance_compare import info_path, same_end, without_paths
from rollsafe.env.conformance_run import CheckFailed
from rollsafe.errors import InvalidInput

FIRST = w.EpisodeRef(rollout_id="lake-0_g0", attempt=0)
AUDIT = w.EpisodeAudit(state_digests={1: "d1", 2: "d2"})


def _result(ref: w.EpisodeRef, info: dict[str, Any]) -> w.EpisodeResult:
    restored = ref.attempt > 0
    return w.EpisodeResult(
        episode=ref, reward=1.0, turns=2, restored=restored, info=info, audit=AUDIT
    )


def _compare(mine: dict[str, Any], theirs: dict[str, Any], declared: tuple[str, ...]) -> list[str]:
    parked = w.ParkedEpisode(episode=FIRST, turn=1, activity="boundary")
    restored = _result(FIRST.next_attempt(), mine)
    return same_end(parked, restored, _result(FIRST, theirs), declared)


def test_declared_attempt_fields_are_left_out_and_the_rest_still_counts() -> None:
    theirs = {"finished": [{"turn": 2, "attempt": 0}], "timings": {"a": 1.0}, "goal": 1}
    mine = {"finished": [{"turn": 2, "attempt": 1}], "timings": {"a": 2.5}, "goal": 1}
    with pytest.raises(CheckFailed, match=r"info\.finished\[0\]\.attempt: 1 != 0"):
        _compare(mine, theirs, ())
    assert _compare(mine, theirs, ("finished[].attempt", "timings.*")) == []
    with pytest.raises(CheckFailed, match=r"info\.goal: 2 != 1"):
        _compare({**mine, "goal": 2}, theirs, ("finished[].attempt", "timings.*"))


def test_paths_name_keys_list_items_and_dict_values() -> None:
    info = {"a": {"b": [{"c": 1, "d": 2}, {"c": 3}]}, "e": {"x": 1, "y": 2}, "f": 0}
    assert without_paths(info, ("a.b[].c", "e.*")) == {"a": {"b": [{"d": 2}, {}]}, "e": {}, "f": 0}
    assert without_paths(info, ("missing.key", "f")) == {k: v for k, v in info.items() if k != "f"}
    assert info["f"] == 0  # the caller's info is not cut
    assert info_path("steps[].attempt") == ["steps", "[]", "attempt"]
    for bad in ("", "a..b", "a[0]", "a[].", "*x"):
        with pytest.raises(InvalidInput, match="attempt_info path"):
            info_path(bad)


def test_the_declarations_ride_in_the_audit_only_when_made() -> None:
    assert set(AUDIT.model_dump(mode="json")) == {"effects", "calls", "generating", "state_digests"}
    declared = w.EpisodeAudit(side_effects=False, attempt_info=("finished[].attempt",))
    again = w.EpisodeAudit.model_validate_json(declared.model_dump_json())
    assert (again.side_effects, again.attempt_info) == (False, ("finished[].attempt",))
