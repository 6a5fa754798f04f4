"""``rollsafe verify``: check a run's evidence files alone, with nothing from the run
itself, so an external checker and this one read the same facts.

Each check returns every violation it finds (the first few named in its detail), never stops
at the first: one run's verdict lists everything that went wrong.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

from rollsafe.evidence.files import Evidence

SHOWN = 5  # violations named per check; the count says how many there are


class Check(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    ok: bool
    detail: str


def _check(name: str, problems: list[str], fine: str) -> Check:
    if not problems:
        return Check(name=name, ok=True, detail=fine)
    shown = "; ".join(problems[:SHOWN])
    more = f" (+{len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
    return Check(name=name, ok=False, detail=f"{len(problems)} violation(s): {shown}{more}")


def handed_out_contiguous(evidence: Evidence) -> Check:
    counts = Counter(line.group_idx for line in evidence.handed_out)
    problems = [f"group {idx} listed {n} times" for idx, n in sorted(counts.items()) if n > 1]
    top = max(counts, default=-1)
    problems += [f"group {idx} never handed out" for idx in range(top + 1) if idx not in counts]
    return _check(
        "handed-out groups contiguous from 0",
        problems,
        f"{len(counts)} groups, 0..{top}" if counts else "no group handed out",
    )


def trained_exactly_once(evidence: Evidence) -> Check:
    size = evidence.report.group_size
    status = {line.group_idx: line.status for line in evidence.handed_out}
    steps: dict[int, set[int]] = defaultdict(set)
    rollouts: dict[int, Counter[str]] = defaultdict(Counter)
    for row in evidence.trained:
        steps[row.group_idx].add(row.step)
        rollouts[row.group_idx][row.rollout_id] += 1
    problems: list[str] = []
    for idx in sorted(status):
        if status[idx] == "trained" and idx not in steps:
            problems.append(f"group {idx} is marked trained but no step trained it")
    for idx in sorted(steps):
        if status.get(idx) != "trained":
            problems.append(f"group {idx} was trained but is {status.get(idx, 'never handed out')}")
        if len(steps[idx]) > 1:
            problems.append(f"group {idx} trained by steps {sorted(steps[idx])}")
        if len(rollouts[idx]) != size or any(n > 1 for n in rollouts[idx].values()):
            problems.append(
                f"group {idx} trained with {sum(rollouts[idx].values())} rows of "
                f"{len(rollouts[idx])} rollouts, not its {size}"
            )
    trained = sum(1 for s in status.values() if s == "trained")
    return _check(
        "every trained group trained once, whole",
        problems,
        f"{trained} groups x {size} rollouts, {len(evidence.trained)} rows",
    )


def no_rollout_in_two_steps(evidence: Evidence) -> Check:
    steps: dict[str, list[int]] = defaultdict(list)
    for row in evidence.trained:
        steps[row.rollout_id].append(row.step)
    problems = [f"{rid} in steps {found}" for rid, found in sorted(steps.items()) if len(found) > 1]
    return _check("no rollout in two steps", problems, f"{len(steps)} rollouts, each in one step")


def mutations_unique(evidence: Evidence) -> Check:
    # One mutation per rollout and turn: a repeated tool effect would appear as the same turn
    # applied twice, possibly under another call id or on another instance.
    seen = Counter((m.rollout_id, m.turn) for m in evidence.mutations)
    problems = [f"{rid} turn {turn} applied {n} times" for (rid, turn), n in seen.items() if n > 1]
    return _check(
        "every environment mutation applied once", sorted(problems), f"{len(seen)} mutations"
    )


def same_tokens_as(evidence: Evidence, reference: Evidence) -> Check:
    theirs = {row.rollout_id: row.tokens_sha256 for row in reference.trained}
    problems: list[str] = []
    for row in evidence.trained:
        if row.rollout_id not in theirs:
            problems.append(f"{row.rollout_id} not trained in the reference run")
        elif theirs[row.rollout_id] != row.tokens_sha256:
            problems.append(f"{row.rollout_id} tokens differ from the reference run's")
    return _check(
        "tokens identical to the reference run",
        problems,
        f"{len(evidence.trained)} rollouts match",
    )


def verify(evidence: Evidence, reference: Evidence | None = None) -> list[Check]:
    checks = [
        handed_out_contiguous(evidence),
        trained_exactly_once(evidence),
        no_rollout_in_two_steps(evidence),
        mutations_unique(evidence),
    ]
    if reference is not None:
        checks.append(same_tokens_as(evidence, reference))
    return checks


def all_ok(checks: Iterable[Check]) -> bool:
    return all(check.ok for check in checks)
