"""How env-check compares a restored attempt with the uninterrupted one (no I/O).

A restored attempt must end as the uninterrupted attempt of its rollout did: the same turns,
reward and ``info``, the same model calls from where it was parked (prompt and tokens: the
training row), the same state at every boundary both reached (``state_digest``), and the same
effects, none applied again. Sampling and effects are keyed by rollout and turn, so anything
keyed otherwise (the attempt, a clock, a process's random generator) shows up as a difference.

What names the attempt by design is not a difference: the toolkit's call ids and episode keys
(``<rollout>-a<n>/t<turn>``) are compared with the attempt's key replaced by the uninterrupted
attempt's, and ``info["attempt"]`` is where an environment reports about the attempt itself
(tokens resumed from a prefix, timings): it is left out, and so is every path the environment
declares in ``EnvironmentHooks.attempt_info`` (:func:`without_paths`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from rollsafe.env import protocol as w
from rollsafe.env.conformance_run import expect
from rollsafe.errors import InvalidInput

ATTEMPT_INFO = "attempt"  # info's key for what describes the attempt, not the episode
_SEGMENT = re.compile(r"^(\*|[^.\[\]*]+(\[\])?)$")


def info_path(path: str) -> list[str]:
    """A declared ``attempt_info`` path as its segments (``"steps[].attempt"`` -> ``steps``,
    ``[]``, ``attempt``); :class:`InvalidInput` naming a malformed one."""
    parts: list[str] = []
    for segment in path.split("."):
        if not _SEGMENT.match(segment):
            raise InvalidInput(
                f"attempt_info path {path!r}: segment {segment!r} is not a key, key[] (every "
                "item of its list) or * (every key of a dict)"
            )
        parts += [segment[:-2], "[]"] if segment.endswith("[]") else [segment]
    return parts


def without_paths(info: Any, paths: Sequence[str]) -> Any:
    """``info`` (JSON) without what each of ``paths`` names (see :func:`info_path`)."""
    info = json.loads(json.dumps(info))  # a copy to cut
    for path in paths:
        _drop(info, info_path(path))
    return info


def _drop(node: Any, parts: list[str]) -> None:
    head, rest = parts[0], parts[1:]
    if not rest:  # the last segment: what it names goes
        if head in ("*", "[]") and isinstance(node, dict | list):
            node.clear()
        elif isinstance(node, dict):
            node.pop(head, None)
        return
    if head == "[]":
        children = node if isinstance(node, list) else []
    elif head == "*":
        children = list(node.values()) if isinstance(node, dict) else []
    else:
        children = [node[head]] if isinstance(node, dict) and head in node else []
    for child in children:
        _drop(child, rest)


def as_attempt(value: Any, key: str, into: str) -> Any:
    """``value`` (JSON) with episode key ``key`` written as ``into`` wherever it names it."""
    text = json.dumps(value, sort_keys=True)
    return json.loads(re.sub(re.escape(key) + r"(?![0-9A-Za-z_])", into, text))


def first_difference(a: Any, b: Any, path: str = "info") -> str | None:
    """Where two JSON values first differ, as ``path: a != b`` (None: equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys()):
            if k not in a or k not in b:
                return f"{path}.{k}: only in the {'uninterrupted' if k in b else 'restored'} one"
            if (found := first_difference(a[k], b[k], f"{path}.{k}")) is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items, the uninterrupted attempt's {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if (found := first_difference(x, y, f"{path}[{i}]")) is not None:
                return found
        return None
    return None if a == b else f"{path}: {_short(a)} != {_short(b)}"


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _audit(result: w.EpisodeResult) -> w.EpisodeAudit:
    expect(
        result.audit is not None,
        f"{result.episode.key}: the instance returned no audit for an audited run",
    )
    assert result.audit is not None
    return result.audit


def same_end(
    parked: w.ParkedEpisode,
    restored: w.EpisodeResult,
    end: w.EpisodeResult,
    attempt_info: Sequence[str] = (),
) -> list[str]:
    """Check that ``restored`` (attempt n + 1, continued from ``parked``) ended as ``end``
    (attempt n, uninterrupted), ``attempt_info``'s paths of their info left out; returns
    what could not be compared, and why."""
    key = restored.episode.key
    expect(
        (restored.turns, restored.reward) == (end.turns, end.reward),
        f"{key}: ended with {restored.turns} turns, reward {restored.reward}; the "
        f"uninterrupted attempt with {end.turns} turns, reward {end.reward}: the record did "
        "not carry its state",
    )
    info = without_paths(restored.info, (ATTEMPT_INFO, *attempt_info))
    want = without_paths(end.info, (ATTEMPT_INFO, *attempt_info))
    diff = first_difference(as_attempt(info, key, end.episode.key), want)
    expect(diff is None, f"{key}: its info differs from the uninterrupted attempt's: {diff}")
    mine, theirs = _audit(restored), _audit(end)
    _same_calls(key, parked, mine, theirs, end.episode.key)
    _same_effects(key, parked, mine, theirs)
    return _same_states(key, mine, theirs)


def _same_calls(
    key: str, parked: w.ParkedEpisode, mine: w.EpisodeAudit, theirs: w.EpisodeAudit, into: str
) -> None:
    """From the parked boundary on, the same model calls: name, prompt, tokens."""
    want = [c for c in theirs.calls if c.boundary >= parked.turn]
    expect(
        len(mine.calls) == len(want),
        f"{key}: made {len(mine.calls)} model call(s) after its restore, the uninterrupted "
        f"attempt {len(want)} from turn {parked.turn}: a different training row",
    )
    for got, call in zip(mine.calls, want, strict=True):
        name = as_attempt(got.call_id, key, into)
        what = f"{key}: model call {name} (the uninterrupted attempt's {call.call_id})"
        expect(name == call.call_id, f"{what}: another call: a different training row")
        expect(got.prompt_sha256 == call.prompt_sha256, f"{what}: another prompt")
        expect(
            got.tokens == call.tokens,
            f"{what}: tokens {_short(list(got.tokens))} != {_short(list(call.tokens))}: a "
            "different training row (sampling keyed on something but the rollout and turn?)",
        )


def _same_effects(
    key: str, parked: w.ParkedEpisode, mine: w.EpisodeAudit, theirs: w.EpisodeAudit
) -> None:
    """The same effects as the uninterrupted attempt from the parked turn on, each answered
    from the ledger: the uninterrupted attempt applied them all already."""
    got = [(e.turn, e.name) for e in mine.effects]
    want = [(e.turn, e.name) for e in theirs.effects if e.turn >= parked.turn]
    expect(
        got == want,
        f"{key}: asked for effects {_short(got)}, the uninterrupted attempt {_short(want)} from "
        f"turn {parked.turn}: an effect's key is (rollout, turn, name), never the attempt",
    )
    again = [f"t{e.turn}/{e.name}" for e in mine.effects if e.applied]
    expect(not again, f"{key}: applied effect(s) {', '.join(again)} a second time")


def _same_states(key: str, mine: w.EpisodeAudit, theirs: w.EpisodeAudit) -> list[str]:
    if not theirs.state_digests:
        return ["state digest (the environment implements no state_digest)"]
    for turn, digest in sorted(mine.state_digests.items()):
        want = theirs.state_digests.get(turn)
        expect(
            digest == want,
            f"{key}: its state at turn {turn} differs from the uninterrupted attempt's "
            f"(state_digest {digest[:12]} != {str(want)[:12]}): state the record does not "
            "carry (hidden state lost in the restore?)",
        )
    return []


def applied_once(rollout: w.RolloutEffects, uses: Iterable[w.EffectUse], before: int) -> str:
    """Every effect the instance applied for ``rollout`` from turn ``before`` on is one the
    attempt that finished asked for (``uses``): nothing applied twice under two names, nothing
    applied by an attempt that did not finish and then again by its successor."""
    asked = {(e.turn, e.name) for e in uses}
    by_turn: dict[int, list[w.AppliedEffect]] = {}
    for e in rollout.applied:
        by_turn.setdefault(e.turn, []).append(e)
    twice = sorted(
        turn
        for turn, effects in by_turn.items()
        if turn >= before and any((e.turn, e.name) not in asked for e in effects)
    )
    shown = "; ".join(
        f"t{t}: " + " and ".join(f"{e.name} (attempt {e.attempt})" for e in by_turn[t])
        for t in twice[:3]
    )
    more = f"; and {len(twice) - 3} more turn(s)" if len(twice) > 3 else ""
    expect(
        not twice,
        f"{rollout.rollout_id}: effects applied that the finished attempt did not ask for, "
        f"{shown}{more}: applied twice? An effect's key is (rollout, turn, name), never the "
        "attempt",
    )
    if not rollout.applied:
        return "no effect applied"
    attempts = sorted({e.attempt for e in rollout.applied})
    return f"{len(rollout.applied)} effect(s) applied once each, by attempt(s) {attempts}"
