"""The controller's results and rules across environment instances, without I/O.

:mod:`rollsafe.env.fleet` calls the instances; this module holds what it returns and the pure
checks it applies to their replies (ownership, scope, restore completeness, error summaries),
and where a restore places the episodes of instances no longer in the fleet (:func:`place`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from rollsafe.env.client import rebuild_with_fields
from rollsafe.env.protocol import (
    CommitReply,
    CommitRequest,
    EpisodeRef,
    ParkedEpisode,
    ParticipantManifest,
    PrepareReply,
)
from rollsafe.errors import (
    EnvNotReady,
    InvalidInput,
    InvariantError,
    OwnershipMismatch,
    RollsafeError,
)

M = TypeVar("M", bound=BaseModel)


class _Result(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InstanceInventory(_Result):
    """What one instance reported when it parked."""

    parked: tuple[ParkedEpisode, ...]
    restarts: tuple[EpisodeRef, ...]
    lease_expires_ts: float


class FleetPrepared(_Result):
    checkpoint_id: str
    deadline_ts: float
    instances: dict[str, InstanceInventory]

    @property
    def lease_expires_ts(self) -> float:
        """The first lease to run out: the fleet stays parked at most until then."""
        return min(inv.lease_expires_ts for inv in self.instances.values())

    def owners(self) -> dict[str, str]:
        """rollout id -> the instance that holds it (parked or to restart)."""
        return {
            ref.rollout_id: name
            for name, inv in self.instances.items()
            for ref in (*(p.episode for p in inv.parked), *inv.restarts)
        }


class InstanceCommit(_Result):
    dest: str
    committed: tuple[EpisodeRef, ...]
    missing: tuple[EpisodeRef, ...]  # in scope but not exported: those rollouts must restart
    participants: tuple[ParticipantManifest, ...]


class FleetCommitted(_Result):
    checkpoint_id: str
    instances: dict[str, InstanceCommit]


class FleetRestored(_Result):
    """The outcome of :meth:`EnvFleet.restore_all`: returned, not raised, because a failed
    restore has a planned fallback (restart the rollouts), not a retry.

    ``ok``: every instance restored its whole scope as attempt n + 1; the instances stay in
    phase ``restored`` until the caller's :meth:`EnvFleet.resume_all` (``restore_id``).
    Otherwise nothing restored is kept: the n + 1 attempts of every scope episode were retired
    (``restarts``, each as the retired n + 1 ref: never dispatch it, restart the rollout from
    its input under ``ref.next_attempt()``), every instance was resumed, and ``errors`` says
    per instance what failed (restore, retire or resume). ``restored`` is what each instance
    reported restoring, kept for diagnosis."""

    restore_id: str
    ok: bool
    restored: dict[str, tuple[EpisodeRef, ...]]
    restarts: tuple[EpisodeRef, ...]
    errors: dict[str, str]


class Placement(_Result):
    """Where a restore's committed episodes go on the fleet it finds (:func:`place`)."""

    own: dict[str, tuple[EpisodeRef, ...]]  # instance -> the episodes it committed itself
    # Surviving instance -> lost instance -> the lost one's episodes it restores.
    adopted: dict[str, dict[str, tuple[EpisodeRef, ...]]]
    # Episodes of lost instances whose records are not portable: they restart from scratch.
    stranded: tuple[EpisodeRef, ...]
    lost: dict[str, str]  # lost instance -> what became of its episodes, for the restore plan

    @property
    def moved(self) -> dict[EpisodeRef, str]:
        """Each adopted episode -> the instance that restores it."""
        return {
            ref: name
            for name, by_lost in self.adopted.items()
            for refs in by_lost.values()
            for ref in refs
        }


# -- rules ----------------------------------------------------------------------------------------


def place(
    scope: Mapping[str, Sequence[EpisodeRef]],
    portable: Mapping[str, bool],
    fleet: Sequence[str],
) -> Placement:
    """Place a snapshot's committed episodes (``scope``, by the instance that committed them)
    on ``fleet``: an instance still in it restores its own; the episodes of one that is not
    (lost for good) go to the survivors, each to the one with the fewest so far (ties by name:
    the same snapshot and fleet always place alike), when its records are ``portable``;
    otherwise they restart from scratch, the ladder's next rung. Nothing needs the lost
    instance back, and the plan says what became of each one's episodes."""
    present = set(fleet)
    own = {name: tuple(refs) for name, refs in scope.items() if name in present and refs}
    load = {name: len(own.get(name, ())) for name in sorted(present)}
    adopted: dict[str, dict[str, list[EpisodeRef]]] = {}
    stranded: list[EpisodeRef] = []
    lost: dict[str, str] = {}
    for name in sorted(set(scope) - present):
        refs = sorted(scope[name], key=lambda ref: ref.key)
        if not refs:
            continue
        if not portable.get(name, True) or not load:
            stranded.extend(refs)
            why = "its records are not portable" if load else "no instance is left"
            lost[name] = f"not in the fleet and {why}: {len(refs)} episode(s) restart from scratch"
            continue
        counts: dict[str, int] = {}
        for ref in refs:
            survivor = min(load, key=lambda n: (load[n], n))
            load[survivor] += 1
            adopted.setdefault(survivor, {}).setdefault(name, []).append(ref)
            counts[survivor] = counts.get(survivor, 0) + 1
        where = ", ".join(f"{n} ({c})" for n, c in sorted(counts.items()))
        lost[name] = f"not in the fleet: {len(refs)} episode(s) restored on {where}"
    return Placement(
        own=own,
        adopted={n: {lost_: tuple(r) for lost_, r in by.items()} for n, by in adopted.items()},
        stranded=tuple(stranded),
        lost=lost,
    )


def _reported(replies: Mapping[str, PrepareReply]) -> dict[str, tuple[EpisodeRef, ...]]:
    return {
        name: (*(p.episode for p in reply.parked), *reply.restarts)
        for name, reply in replies.items()
    }


def _twice(op: str, refs_by_instance: Mapping[str, Iterable[EpisodeRef]]) -> Exception | None:
    """An OwnershipMismatch if one rollout is reported by two instances, else None."""
    holders: dict[str, set[str]] = {}
    for name, refs in refs_by_instance.items():
        for ref in refs:
            holders.setdefault(ref.rollout_id, set()).add(name)
    shared = {rid: sorted(names) for rid, names in sorted(holders.items()) if len(names) > 1}
    if not shared:
        return None
    listed = ", ".join(f"{rid} on {' and '.join(names)}" for rid, names in shared.items())
    return OwnershipMismatch(f"{op}: rollout(s) reported by more than one instance: {listed}")


def _commit_problems(name: str, request: CommitRequest, reply: CommitReply) -> list[str]:
    problems = []
    outside = [ref.key for ref in reply.committed if ref not in set(request.scope)]
    if outside:
        problems.append(f"{name} exported episode(s) outside its scope: {', '.join(outside)}")
    for manifest in reply.participants:
        if (manifest.instance, manifest.checkpoint_id) != (name, request.checkpoint_id):
            problems.append(
                f"{name}'s participant {manifest.name} is for instance {manifest.instance!r}, "
                f"checkpoint {manifest.checkpoint_id!r}"
            )
    return problems


def _instance_commit(request: CommitRequest, reply: CommitReply) -> InstanceCommit:
    committed = set(reply.committed)
    return InstanceCommit(
        dest=request.dest,
        committed=reply.committed,
        missing=tuple(ref for ref in request.scope if ref not in committed),
        participants=reply.participants,
    )


def _restore_problem(scope: Sequence[EpisodeRef], restored: Sequence[EpisodeRef]) -> str:
    expected = {ref.next_attempt() for ref in scope}
    missing = sorted(ref.key for ref in expected - set(restored))
    extra = sorted(ref.key for ref in set(restored) - expected)
    parts = [f"did not restore {', '.join(missing)}"] if missing else []
    parts += [f"restored episode(s) not asked for: {', '.join(extra)}"] if extra else []
    return "; ".join(parts)


def _rank(exc: Exception) -> int:
    """Severity: the summary of several failures takes the class of the worst one."""
    if not isinstance(exc, RollsafeError):
        return 4  # a bug, not an answer: never dressed up as a retryable error
    if isinstance(exc, InvariantError):
        return 3
    if isinstance(exc, InvalidInput):
        return 2
    return 0 if isinstance(exc, EnvNotReady) else 1


def failures_summary(op: str, failed: Mapping[str, Exception], total: int) -> Exception:
    """One error for several instances' failures, naming each instance."""
    listed = "; ".join(f"{name}: {exc}" for name, exc in sorted(failed.items()))
    message = f"{op} failed on {len(failed)} of {total} instance(s): {listed}"
    worst = max(failed.values(), key=_rank)
    if not isinstance(worst, RollsafeError):
        worst.add_note(message)
        return worst
    error = rebuild_with_fields(worst, message)
    error.__cause__ = worst
    return error


def _distinct(refs: Iterable[EpisodeRef]) -> tuple[EpisodeRef, ...]:
    return tuple(dict.fromkeys(refs))


def _build(model: type[M], **fields: Any) -> M:
    """A protocol message from caller input: a bad value is the caller's InvalidInput."""
    try:
        return model(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise InvalidInput(f"{model.__name__}.{where}: {first['msg']}") from None
