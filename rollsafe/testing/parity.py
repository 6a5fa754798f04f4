"""Is a resumed call the uninterrupted one? Field by field, with where it first differs; and
a call's whole completion through any engine (in process, over HTTP, through Ray)."""

from __future__ import annotations

from collections.abc import Sequence

from rollsafe.engine.protocol import (
    Completion,
    Engine,
    GenerateRequest,
    PrefixRecord,
    completion_of,
)

_FIELDS = ("tokens", "logprobs", "weight_versions", "routes")


async def completed(
    engine: Engine, request: GenerateRequest, prefix: PrefixRecord | None = None
) -> Completion:
    """The call run to its end on ``engine``: generated, or resumed from ``prefix``."""
    stream = engine.generate(request) if prefix is None else engine.resume(request, prefix)
    return completion_of(request.call_id, [event async for event in stream], prefix)


def mismatches(want: Sequence[Completion], got: Sequence[Completion]) -> list[str]:
    """One line per difference between two lists of completions (same calls, same order);
    empty when every call made exactly the same tokens, logprobs (bit for bit), weight
    versions, routes and finish reason."""
    if [c.call_id for c in want] != [c.call_id for c in got]:
        return [f"calls differ: {[c.call_id for c in want]} vs {[c.call_id for c in got]}"]
    found = []
    for a, b in zip(want, got, strict=True):
        for name in _FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            if x == y:
                continue
            if x is None or y is None:
                found.append(f"{a.call_id}: {name} {x!r:.40} vs {y!r:.40}")
                continue
            pairs = enumerate(zip(x, y, strict=False))  # lengths may differ: said below
            at = next((i for i, (p, q) in pairs if p != q), min(len(x), len(y)))
            found.append(
                f"{a.call_id}: {name} differ from index {at} ({len(x)} vs {len(y)} entries)"
            )
        if a.finish_reason != b.finish_reason:
            found.append(f"{a.call_id}: finish {a.finish_reason} vs {b.finish_reason}")
    return found
