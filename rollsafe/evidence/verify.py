"""``rollsafe verify``: check a run's evidence files alone, with nothing from the run
itself, so an external checker and this one read the same facts.

Each check returns every violation it finds (the first few named in its detail), never stops
at the first: one run's verdict lists everything that went wrong.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from rollsafe.evidence.files import Evidence, GenerationEvent

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


@dataclass
class Generations:
    """What the run's generation cost across its crashes (``generations.jsonl``)."""

    sealed_twice: dict[str, int] = field(default_factory=dict)  # rollout id -> seals
    lost_s: float = 0.0  # generating rollouts sealed before a crash, generated again after
    redone_s: float = 0.0  # generating attempts still in flight when the run was killed
    sealed: int = 0  # rollouts sealed


def account_generations(events: Iterable[GenerationEvent]) -> Generations:
    """Pairs each attempt's start with its seal (or the kill that ended it first)."""
    found = Generations()
    open_: dict[tuple[str, int], float] = {}
    seals: dict[str, list[float]] = defaultdict(list)  # rollout -> each seal's seconds
    for event in sorted(events, key=lambda e: e.at_unix):
        if event.event == "killed":
            found.redone_s += sum(event.at_unix - began for began in open_.values())
            open_.clear()
            continue
        assert event.rollout_id is not None and event.attempt is not None
        key = (event.rollout_id, event.attempt)
        if event.event == "started":
            open_[key] = event.at_unix
        elif (began := open_.pop(key, None)) is not None:
            seals[event.rollout_id].append(event.at_unix - began)
    for rollout_id, seconds in seals.items():
        if len(seconds) > 1:
            found.sealed_twice[rollout_id] = len(seconds)
            found.lost_s += sum(seconds[:-1])
    found.sealed = len(seals)
    return found


def no_sealed_rollout_generated_twice(evidence: Evidence) -> Check:
    found = account_generations(evidence.generations)
    problems = [f"{rid} sealed {n} times" for rid, n in sorted(found.sealed_twice.items())]
    return _check(
        "no sealed rollout generated twice",
        problems,
        f"{found.sealed} rollouts sealed once each; {found.lost_s:.1f} generation-seconds lost "
        f"to crashes, {found.redone_s:.1f} in-flight generation-seconds redone",
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
    # With the journal nothing sealed is generated again, but at the prompt_group level a
    # group still unfinished at a restore is regenerated whole, sealed siblings included.
    report = evidence.report
    if report.journal and report.restore_level != "prompt_group" and evidence.generations:
        checks.append(no_sealed_rollout_generated_twice(evidence))
    if reference is not None:
        checks.append(same_tokens_as(evidence, reference))
    return checks


def all_ok(checks: Iterable[Check]) -> bool:
    return all(check.ok for check in checks)
