"""The conformance checks that restore episodes (:mod:`rollsafe.env.conformance`): a task
long enough to park mid-way, a restored attempt that ends as the uninterrupted one did
(:mod:`rollsafe.env.conformance_compare`), a cut call that resumes from its staged prefix
(given the instance's engine), and an attempt abandoned mid-turn while its restored successor
runs: it stops, and no effect is applied twice."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from rollsafe.engine.protocol import Engine, PrefixRecord
from rollsafe.env import protocol as w
from rollsafe.env.conformance_compare import applied_once, info_path, same_end
from rollsafe.env.conformance_run import (
    EPISODE_S,
    MIN_TASK_TURNS,
    Run,
    Skip,
    Wanted,
    expect,
    park_commit,
)
from rollsafe.errors import EnvRefused, EpisodeParked, InvalidInput

# How long an abandoned attempt may go on once its successor is restored: it must stop at its
# next boundary or effect, which a turn reaches in well under this.
ABANDONED_STOP_S = 30.0


async def probe(r: Run) -> None:
    """One episode of the task, uninterrupted and audited: long enough to be parked mid-way?
    What it makes (model calls, effects, state digests) says which comparisons apply; its
    pace paces the restore checks' prepares."""
    began = time.monotonic()
    try:
        result = await r.run(r.new_ref())
    except (EnvRefused, EpisodeParked) as exc:
        raise InvalidInput(f"the task's probe episode was refused: {exc}") from None
    except InvalidInput as exc:
        if "audit" not in str(exc):
            raise
        raise InvalidInput(
            f"the instance refused an audited run ({exc}): its rollsafe toolkit predates "
            "env-check's audits; serve it with this release"
        ) from None
    if result.turns < MIN_TASK_TURNS:
        raise InvalidInput(
            f"the task ran {result.turns} turn(s); env-check needs one of at least "
            f"{MIN_TASK_TURNS}, so that an episode can be parked after its first turn and its "
            "restore checked: give a longer task"
        )
    if result.audit is None:
        raise InvalidInput("the instance returned no audit for an audited run: not a toolkit")
    r.turn_s = (time.monotonic() - began) / result.turns
    r.probe = result
    made, seen = result.audit.generating, len(result.audit.calls)
    if made > seen:
        r.not_compared.add(
            f"the training row of {made - seen} of {made} model call(s) (made without "
            "session.complete, their tokens cannot be seen)"
        )
    declared = result.audit
    for path in declared.attempt_info:
        info_path(path)  # a malformed declaration is named before any check runs
    r.attempt_info = declared.attempt_info
    if not declared.effects and declared.side_effects:
        r.not_compared.add(
            "effects (the episode made none through session.effect; one made any other way "
            "cannot be seen, and the environment does not declare side_effects = False)"
        )
        r.not_verified.add("effects")
    if not declared.state_digests:
        r.not_verified.add("state")


def _mid_way(r: Run) -> Wanted:
    """A prepare that parked one of this check's episodes after its first turn."""

    async def wanted(prep: w.PrepareReply) -> bool:
        return any(p.turn >= 1 and p.episode.key in r.running for p in prep.parked)

    return wanted


async def restore(r: Run) -> str:
    cid, prep, commit, dest = await park_commit(r, 2, _mid_way(r))
    ends = await _let_finish(r, cid)
    results = await _restore_and_run(r, cid, commit, dest, {})
    parked = {p.episode.key: p for p in prep.parked}
    for ep, result in zip(commit.committed, results, strict=True):
        await _continued(r, parked[ep.key], result, ends[ep.key])
    turns = ", ".join(f"{ep.key} at turn {parked[ep.key].turn}" for ep in commit.committed)
    return f"restored {turns}; each ended as the uninterrupted attempt did"


async def cut_resume(r: Run) -> str:
    """An episode parked generating has its call cut on the engine; the restored attempt must
    resume that call from the staged prefix (``prefix_tokens``), not generate it again."""
    engine = r.engine
    if r.probe is not None and r.probe.audit is not None and not r.probe.audit.generating:
        return "not applicable: the task's episode waits on no model call (session.generating)"
    if engine is None:
        raise Skip("the episode makes model calls: give the instance's engine (--engine-url)")
    prefixes: dict[str, PrefixRecord] = {}

    async def cut(prep: w.PrepareReply) -> bool:
        calls = [  # mid-way, so that the restored attempt has a record to continue
            p.model_call_id
            for p in prep.parked
            if p.activity == "generating"
            and p.model_call_id
            and p.turn >= 1
            and p.episode.key in r.running
        ]
        for prefix in await _cut_with_tokens(engine, calls):
            prefixes[prefix.call_id] = prefix
            r.frozen.append(prefix.call_id)
        return bool(prefixes)

    cid, prep, commit, dest = await park_commit(r, 3, cut)
    await engine.release(r.frozen)  # the uninterrupted attempts go on with their calls
    ends = await _let_finish(r, cid)
    staged = {call: prefix.model_dump(mode="json") for call, prefix in prefixes.items()}
    results = await _restore_and_run(r, cid, commit, dest, staged)
    parked = {p.episode.key: p for p in prep.parked}
    done = []
    for ep, result in zip(commit.committed, results, strict=True):
        await _continued(r, parked[ep.key], result, ends[ep.key])
        prefix = prefixes.get(parked[ep.key].model_call_id or "")
        if prefix is not None:
            want = len(prefix.tokens)
            expect(
                result.prefix_tokens >= want,
                f"{result.episode.key}: took {result.prefix_tokens} tokens from staged "
                f"prefixes, want at least {want} (call {prefix.call_id} was cut there): it "
                "generated the cut call again instead of resuming it",
            )
            done.append(f"{prefix.call_id} resumed after {want} tokens")
    return "; ".join(done)


async def abandoned(r: Run) -> str:
    """The trainer dies: attempts committed mid-way and then run on are abandoned mid-turn
    (their caller gone) and their successors restored from the commit while they still run.
    Each abandoned attempt must stop (superseded) and its successor finish, with no effect
    applied twice across the two."""

    cid, prep, commit, dest = await park_commit(r, 3, _mid_way(r))
    await r.resume(cid)
    for task in r.running.values():
        task.cancel()  # the caller is gone; the instance runs the attempt on
    await asyncio.gather(*r.running.values(), return_exceptions=True)
    r.running = {}
    turns = {p.episode.key: p.turn for p in prep.parked}
    running = [await _past_the_commit(r, ep, turns[ep.key]) for ep in commit.committed]
    results = await _restore_and_run(r, cid, commit, dest, {})
    done = []
    for ep, result, ran in zip(commit.committed, results, running, strict=True):
        effects = await _stopped(r, ep, result.episode)
        once = applied_once(effects, _uses(result), turns[ep.key])
        state = "running at the restore, then ended" if ran else "had ended by itself"
        done.append(f"{ep.key} abandoned after turn {turns[ep.key]}, {state}; {once}")
    if not any(running):
        r.not_compared.add(
            "the fence (every abandoned attempt ended before its successor was restored: "
            "give a longer task)"
        )
    return "; ".join(done)


async def _stopped(r: Run, ep: w.EpisodeRef, successor: w.EpisodeRef) -> w.RolloutEffects:
    """The ledger of ``ep``'s rollout once ``ep`` runs no more (bounded)."""
    deadline = time.monotonic() + ABANDONED_STOP_S
    while ep.attempt in (effects := await _ledger(r, ep)).live_attempts:
        expect(
            time.monotonic() < deadline,
            f"the abandoned attempt {ep.key} still ran {ABANDONED_STOP_S:.0f}s after its "
            f"successor {successor.key} was restored: nothing stopped it",
        )
        await asyncio.sleep(0.05)
    return effects


async def _past_the_commit(r: Run, ep: w.EpisodeRef, turn: int) -> bool:
    """Wait until the abandoned attempt applied an effect past its committed turn (when the
    task's episodes make effects), so that its successor redoes a turn it did; whether it
    still runs then."""
    deadline = time.monotonic() + EPISODE_S
    makes_effects = r.probe is not None and bool(_uses(r.probe))
    while True:
        ledger = await _ledger(r, ep)
        if ep.attempt not in ledger.live_attempts:
            return False
        past = any(e.attempt == ep.attempt and e.turn >= turn for e in ledger.applied)
        if past or not makes_effects:
            return True
        expect(time.monotonic() < deadline, f"{ep.key} applied no effect past turn {turn}")
        await asyncio.sleep(r.turn_s / 4)


def _uses(result: w.EpisodeResult) -> tuple[w.EffectUse, ...]:
    return () if result.audit is None else result.audit.effects


async def _continued(
    r: Run, parked: w.ParkedEpisode, result: w.EpisodeResult, end: w.EpisodeResult
) -> None:
    """Attempt n + 1 continued where attempt n was parked, and ended as attempt n did; the
    instance applied no effect of the rollout under a key attempt n did not use."""
    applied_once(await _ledger(r, end.episode), _uses(end), 0)
    key, turn = result.episode.key, parked.turn
    expect(result.restored, f"{key}: a restored attempt says restored=False")
    at = result.restored_at_turn
    expect(at is not None, f"{key}: says restored but not where it continued (restored_at_turn)")
    expect(
        at is not None and turn <= at <= turn + 1,
        f"{key}: continued from turn {at}, but it was parked at turn {turn} ({parked.activity}):"
        " it did not continue its record (restarted, applying earlier turns again?)",
    )
    r.not_compared.update(same_end(parked, result, end, r.attempt_info))


async def _ledger(r: Run, episode: w.EpisodeRef) -> w.RolloutEffects:
    """What the instance's effect ledger holds of ``episode``'s rollout."""
    reply = await r.env.effects(w.EffectsRequest(rollouts=(episode.rollout_id,)))
    return reply.rollouts[0]


async def _cut_with_tokens(engine: Engine, calls: list[str]) -> list[PrefixRecord]:
    """Cut ``calls``; one refused for having no token yet is still generating (its episode is
    parked, so its response would be held): cut it again once it has one, within a second."""
    prefixes: list[PrefixRecord] = []
    deadline = time.monotonic() + 1.0
    while calls:
        report = await engine.cut(calls)
        prefixes.extend(report.prefixes)
        calls = [c.call_id for c in report.refused if c.reason == "no_tokens"]
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    return prefixes


async def _let_finish(r: Run, cid: str) -> dict[str, w.EpisodeResult]:
    """Resume the checkpoint: the uninterrupted attempts run to their end (their results)."""
    await r.resume(cid)
    return dict(zip(r.running, await r.finish(r.running, EPISODE_S, "after resume"), strict=True))


async def _restore_and_run(
    r: Run, cid: str, commit: w.CommitReply, dest: Path, prefixes: dict[str, Any]
) -> list[w.EpisodeResult]:
    """Restore the committed episodes as attempt n + 1 (refused until resumed), resume, run."""
    expect(bool(commit.committed), "no episode of this check's was parked to commit")
    rid, nexts = r.new_id(), tuple(e.next_attempt() for e in commit.committed)
    request = w.RestoreRequest(
        restore_id=rid,
        source_checkpoint_id=cid,
        root=str(dest),
        scope=commit.committed,
        prefixes=prefixes,
        deadline_ts=time.time() + 30,
    )
    reply = await r.env.restore(request)
    expect(reply.restored == nexts, f"restore listed {reply.restored}, want {nexts}")
    status = await r.env.status()
    expect((status.phase, status.checkpoint_id) == ("restored", rid), f"status: {status}")
    await r.refused(r.run(nexts[0], 5), "checkpoint_parked", "attempt n+1 before resume")
    expect((await r.resume(rid)).resumed, f"resume of restore {rid} did not resume it")
    return list(await asyncio.gather(*(r.run(ep) for ep in nexts)))
