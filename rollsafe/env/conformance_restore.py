"""The conformance checks that restore episodes (:mod:`rollsafe.env.conformance`): a task
long enough to park mid-way, a restored attempt that continues its record, and a cut call that
resumes from its staged prefix (given the instance's engine)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from rollsafe.engine.protocol import Engine, PrefixRecord
from rollsafe.env import protocol as w
from rollsafe.env.conformance_run import (
    EPISODE_S,
    MIN_TASK_TURNS,
    Run,
    Skip,
    expect,
    park_commit,
)
from rollsafe.errors import EnvRefused, EpisodeParked, InvalidInput


async def probe(r: Run) -> None:
    """One episode of the task, uninterrupted: long enough to be parked mid-way? Its pace
    paces the restore check's prepares."""
    began = time.monotonic()
    try:
        result = await r.run(r.new_ref())
    except (EnvRefused, EpisodeParked) as exc:
        raise InvalidInput(f"the task's probe episode was refused: {exc}") from None
    if result.turns < MIN_TASK_TURNS:
        raise InvalidInput(
            f"the task ran {result.turns} turn(s); env-check needs one of at least "
            f"{MIN_TASK_TURNS}, so that an episode can be parked after its first turn and its "
            "restore checked: give a longer task"
        )
    r.turn_s = (time.monotonic() - began) / result.turns


async def restore(r: Run) -> str:
    async def mid_way(prep: w.PrepareReply) -> bool:
        return any(p.turn >= 1 and p.episode.key in r.running for p in prep.parked)

    cid, prep, commit, dest = await park_commit(r, 2, mid_way)
    ends = await _let_finish(r, cid)
    results = await _restore_and_run(r, cid, commit, dest, {})
    parked = {p.episode.key: p for p in prep.parked}
    for ep, result in zip(commit.committed, results, strict=True):
        continued(parked[ep.key], result, ends[ep.key])
    turns = ", ".join(f"{ep.key} at turn {parked[ep.key].turn}" for ep in commit.committed)
    return f"restored {turns}; each continued its record to the uninterrupted end"


async def cut_resume(r: Run) -> str:
    """An episode parked generating has its call cut on the engine; the restored attempt must
    resume that call from the staged prefix (``prefix_tokens``), not generate it again."""
    engine = r.engine
    if engine is None:
        raise Skip("no engine given (--engine-url): no call to cut")
    prefixes: dict[str, PrefixRecord] = {}

    async def cut(prep: w.PrepareReply) -> bool:
        calls = [
            p.model_call_id
            for p in prep.parked
            if p.activity == "generating" and p.model_call_id and p.episode.key in r.running
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
        continued(parked[ep.key], result, ends[ep.key])
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


def continued(parked: w.ParkedEpisode, result: w.EpisodeResult, end: w.EpisodeResult) -> None:
    """Attempt n + 1 continued where attempt n was parked, and ended as attempt n did."""
    key, turn = result.episode.key, parked.turn
    expect(result.restored, f"{key}: a restored attempt says restored=False")
    at = result.restored_at_turn
    expect(at is not None, f"{key}: says restored but not where it continued (restored_at_turn)")
    expect(
        at is not None and turn <= at <= turn + 1,
        f"{key}: continued from turn {at}, but it was parked at turn {turn} ({parked.activity}):"
        " it did not continue its record (restarted, applying earlier turns again?)",
    )
    expect(
        (result.turns, result.reward) == (end.turns, end.reward),
        f"{key}: ended with {result.turns} turns, reward {result.reward}; the uninterrupted "
        f"attempt with {end.turns} turns, reward {end.reward}: the record did not carry its state",
    )
