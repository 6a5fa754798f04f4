"""A conformance suite for any server speaking the checkpoint protocol (``/checkpoint/v1``).

Each check returns a detail line or raises :class:`CheckFailed`, and leaves the instance idle.
Ids are fresh. Commit files are verified here when the URL is a loopback one (else missing
files are a warning). An episode parked ``generating`` must stay committable even though this
suite cuts no engine call: a conforming server holds a response that arrives while parked.

A task is required: one episode runs first, uninterrupted and audited (its effects, model
calls and state digests); a task shorter than :data:`MIN_TASK_TURNS` turns is refused up front
(an episode must be parked mid-way for its restore to be checked). The restore checks park
episodes after their first turn, restore them as attempt n + 1 and require each to continue
its record and end as the uninterrupted attempt did (:mod:`rollsafe.env.conformance_compare`:
turns, reward, info, the training row, state digests, effects none applied twice); one
abandons an attempt mid-turn and restores its successor while it runs. An environment that
restarts a restored attempt from its task fails them.

A check that cannot run (no engine given for an episode that makes model calls, no lease
wait) is *skipped* with its reason, and a report with one is not passed: env-check exits 2.
What a check could not compare because the environment does not offer it (no state_digest
hook, no effect) is listed in the report's ``not_compared``; of those, the two that decide
whether a restore is lossless (``effects``: none went through ``session.effect`` and the
environment does not declare ``side_effects = False``; ``state``: no ``state_digest``) are its
``not_verified``, and every check passing with one is "passed, not verified" (exit 3), never a
plain pass. Paths of ``info`` the environment declares as the attempt's (``attempt_info``) are
left out of the comparisons."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from rollsafe.engine.http import EngineClient
from rollsafe.env import protocol as w
from rollsafe.env import store
from rollsafe.env.conformance_restore import abandoned, cut_resume, probe, restore
from rollsafe.env.conformance_run import (
    EPISODE_S,
    CheckFailed,
    Run,
    Skip,
    expect,
    park_commit,
    prep_request,
)
from rollsafe.errors import EnvUnavailable, InvalidInput


class CheckResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    passed: bool = Field(description="it ran and passed")
    detail: str
    seconds: float = Field(ge=0)
    skipped: bool = Field(default=False, description="it could not run here; detail says why")


class ConformanceReport(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    instance: str | None
    passed: bool = Field(description="every check ran and passed")
    seconds: float = Field(ge=0)
    checks: tuple[CheckResult, ...]
    not_compared: tuple[str, ...] = Field(
        default=(), description="what the environment offers no way to compare, and why"
    )
    not_verified: tuple[str, ...] = Field(
        default=(),
        description="what decides a lossless restore and could not be compared: effects, state",
    )

    @property
    def skipped(self) -> tuple[CheckResult, ...]:
        return tuple(c for c in self.checks if c.skipped)


def _verify_files(r: Run, dest: Path, cid: str, commit: w.CommitReply) -> str:
    expect(bool(commit.participants), "commit named no participant manifest")
    keys, missing = {e.key for e in commit.committed}, []
    for m in commit.participants:
        expect(m.checkpoint_id == cid, f"{m.name}'s manifest names {m.checkpoint_id}, not {cid}")
        path = dest / m.name / store.MANIFEST
        if not path.exists():
            missing.append(m.name)
            continue
        on_disk = w.ParticipantManifest.model_validate_json(path.read_bytes())
        expect(on_disk == m, f"{path} differs from the commit reply's manifest")
        records = store.read_records(dest, m.name, cid)  # digest, count, checkpoint id
        named = {w.EpisodeRef.model_validate(x["episode"]).key for x in records}
        expect(named <= keys, f"{m.name} wrote records outside the scope: {sorted(named - keys)}")
        expect(m.kind != "environment" or named == keys, f"{m.name} left out {keys - named}")
    expect(not (missing and r.local_files), f"no manifest under {dest} for {missing} (local)")
    verified = f"{len(commit.participants) - len(missing)} manifest(s) verified on disk"
    return f"{verified}; warning: none here for {missing} (a remote disk)" if missing else verified


async def status_shape(r: Run) -> str:
    reply = await r.raw("status")
    expect(reply.status_code == 200, f"status answered {reply.status_code}: {reply.text[:200]}")
    status = w.StatusReply.model_validate_json(reply.content)
    expect(status.phase == "idle" and status.checkpoint_id is None, f"not idle: {status}")
    r.instance = status.instance
    return f"instance {status.instance}, participants {', '.join(status.participants)}"


async def auth(r: Run) -> str:
    before, cid = await r.idle(), r.new_id()  # resumed at the end, should a 401 prepare open it
    body = prep_request(cid).model_dump_json()
    for label, headers in (("a wrong", {"authorization": "Bearer conf-wrong"}), ("no", {})):
        for op in ("status", "prepare"):
            reply = await r.raw(op, body.encode() if op == "prepare" else None, headers)
            expect(reply.status_code == 401, f"{op} with {label} token: {reply.status_code}")
    expect((await r.idle()).retired == before.retired, "a refused request changed the status")
    await r.env.prepare(prep_request(cid))  # the refused prepare left its id usable
    return "401 on status and prepare for a wrong and a missing token; nothing changed"


async def malformed_bodies(r: Run) -> str:
    before, cid, ts = await r.idle(), r.new_id(), time.time() + 10
    ref = {"rollout_id": "conf-bad id", "attempt": 0}
    cases: list[tuple[str, bytes | dict[str, Any], str | None]] = [
        ("prepare", b'{"checkpoint_id": ', None),
        ("prepare", {"checkpoint_id": cid, "deadline_ts": ts, "colour": 1}, "colour"),
        ("prepare", {"checkpoint_id": cid}, "deadline_ts"),
        ("prepare", {"checkpoint_id": cid, "deadline_ts": "soon"}, "deadline_ts"),
        ("prepare", f'{{"checkpoint_id": "{cid}", "deadline_ts": 1e400}}'.encode(), "deadline_ts"),
        ("commit", {"checkpoint_id": cid, "scope": "all", "dest": "/tmp"}, "scope"),
        ("run", {"episode": ref, "task": {}}, "rollout_id"),
    ]
    for op, body, field in cases:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        reply, what = await r.raw(op, content), f"{op} {content[:100]!r}"
        expect(reply.status_code == 422, f"{what}: {reply.status_code}, want 422")
        detail = w.ErrorReply.model_validate_json(reply.content).detail
        expect(field is None or field in detail, f"{what}: detail {detail!r} names no {field}")
    expect((await r.idle()).retired == before.retired, "a malformed request changed the status")
    return f"{len(cases)} malformed bodies: 422 naming the field"


async def prepare_commit_resume(r: Run) -> str:
    cid, prep, commit, dest = await park_commit(r, 3)
    expect(not r.running or bool(prep.parked or prep.restarts), "no episode in flight at prepare")
    await r.refused(r.run(r.new_ref(), 5), "checkpoint_parked", "a new episode while committed")
    renew = await r.env.renew(w.RenewRequest(checkpoint_id=cid, deadline_ts=time.time() + 30))
    expect(renew.lease_expires_ts > prep.lease_expires_ts, "renew did not extend the lease")
    status = await r.env.status()
    expect((status.phase, status.checkpoint_id) == ("committed", cid), f"status: {status}")
    files = _verify_files(r, dest, cid, commit)
    expect((done := await r.resume(cid)) == w.ResumeReply(phase="idle", resumed=True), str(done))
    await r.idle()  # not merely said: a lost resume would keep the episodes parked
    results = await r.finish(r.running, EPISODE_S, "after resume")
    expect(not any(x.restored for x in results), "a fresh episode says restored")
    kinds, n = [p.activity for p in prep.parked], len(commit.committed)
    return f"{len(r.running)} running, parked {kinds}, committed {n}; {files}"


async def idempotent_replay(r: Run) -> str:
    """Each operation repeated replies as the first did, a commit that holds parked episodes
    included (its records are not written again, nor differently)."""

    async def holds_one(prep: w.PrepareReply) -> bool:
        return any(p.episode.key in r.running for p in prep.parked)

    cid, prep, done, dest = await park_commit(r, 2, holds_one)
    request = w.PrepareRequest(checkpoint_id=cid, deadline_ts=time.time() + 10)
    expect(await r.env.prepare(request) == prep, "a repeated prepare replied differently")
    again = await r.commit(cid, done.committed, dest)
    expect(again == done, f"a repeated commit replied differently: {again} != {done}")
    expect(bool(done.committed), "the commit held no parked episode")
    once, twice = await r.resume(cid), await r.resume(cid)
    expect(once.resumed and twice == once, f"resume replied {once}, then {twice}")
    await r.finish(r.running, EPISODE_S, "after resume")
    sha, n = done.participants[0].sha256[:12], len(done.committed)
    return f"prepare, commit of {n} parked episode(s) (sha256 {sha}) and resume replayed"


async def resumed_id_refused(r: Run) -> str:
    cid = r.new_id()
    await r.env.prepare(prep_request(cid))
    await r.resume(cid)
    await r.refused(r.env.prepare(prep_request(cid)), "checkpoint_resumed", "prepare again")
    renew = w.RenewRequest(checkpoint_id=cid, deadline_ts=time.time() + 10)
    await r.refused(r.env.renew(renew), "checkpoint_resumed", "renew after resume")
    return "prepare and renew of a resumed id: 409 checkpoint_resumed"


async def wrong_phase(r: Run) -> str:
    a, b = r.new_id(), r.new_id()
    idle = await r.refused(r.commit(r.new_id(), (), r.new_dir()), None, "commit before prepare")
    await r.env.prepare(prep_request(a))
    r.retired.append(ref := r.new_ref())
    await r.refused(r.env.retire(w.RetireRequest(rollouts=(ref,))), "wrong_phase", "retire")
    await r.refused(r.env.prepare(prep_request(b)), "other_checkpoint", "a second prepare")
    await r.refused(r.commit(b, (), r.new_dir()), "other_checkpoint", "commit of another id")
    other, status = await r.resume(b), await r.env.status()
    expect(not other.resumed and status.checkpoint_id == a, f"resume of {b} touched {a}")
    return f"commit while idle: 409 {idle}; retire, other checkpoint ids refused while prepared"


async def retire_forget(r: Run) -> str:
    r.retired.append(ref := r.new_ref())
    retired = await r.env.retire(w.RetireRequest(rollouts=(ref,)))
    expect(retired.count == 1 and (await r.idle()).retired >= 1, f"retire counted {retired}")
    await r.refused(r.run(ref, 10), "retired", "running a retired episode")
    forgot = await r.env.forget(w.ForgetRequest(rollouts=(ref,)))
    expect(forgot.count == 1, f"forget counted {forgot.count}, want 1")
    result = await r.run(ref)
    return f"retired episode refused; after forget it ran {result.turns} turns"


async def lease_expiry(r: Run) -> str:
    if r.lease_wait_s <= 0:
        raise Skip("lease_wait_s is 0: not waiting for a lease to run out")
    cid, deadline = r.new_id(), time.time() + 1
    prep = await r.env.prepare(w.PrepareRequest(checkpoint_id=cid, deadline_ts=deadline))
    while (status := await r.env.status()).phase != "idle":
        late = time.time() - deadline
        expect(late < r.lease_wait_s + 0.5, f"still {status.phase} {late:.1f}s past the deadline")
        await asyncio.sleep(0.1)
    late, grace = time.time() - deadline, prep.lease_expires_ts - deadline
    again = r.env.prepare(prep_request(cid))
    await r.refused(again, "checkpoint_resumed", "preparing the expired id")
    return f"idle {late:.1f}s past the deadline (lease grace {grace:.1f}s); the id is refused"


Check = Callable[[Run], Awaitable[str]]
CHECKS: tuple[Check, ...] = (status_shape, auth, malformed_bodies, prepare_commit_resume)
CHECKS += (idempotent_replay, resumed_id_refused, wrong_phase, retire_forget, restore)
CHECKS += (cut_resume, abandoned, lease_expiry)


async def _check(r: Run, fn: Check) -> CheckResult:
    began, skipped = time.monotonic(), False
    try:
        detail, passed = await fn(r), True  # every call and wait in it has a time limit
    except Skip as exc:
        detail, passed, skipped = str(exc), False, True
    except Exception as exc:  # CheckFailed, or whatever the server did: reported as found
        passed = False
        detail = str(exc) if isinstance(exc, CheckFailed) else f"{type(exc).__name__}: {exc}"
    try:
        problem = await r.cleanup()
    except Exception as exc:
        problem = f"cleanup failed: {type(exc).__name__}: {exc}"
    if problem:
        passed, detail = False, f"{detail}; {problem}"
    seconds, name = time.monotonic() - began, fn.__name__
    return CheckResult(name=name, passed=passed, skipped=skipped, detail=detail, seconds=seconds)


async def run_conformance(
    url: str,
    token: str,
    *,
    task: dict[str, Any],
    lease_wait_s: float = 60.0,
    engine_url: str | None = None,
    engine_token: str | None = None,
    snapshot_root: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> ConformanceReport:
    """Run every check against the (idle) instance at ``url``, in turn, reporting each done
    one to ``progress``; with the instance's engine (``engine_url``), a call is cut and must
    resume. Commits go to a fresh directory under ``snapshot_root`` (the instance's
    ``--snapshot-root``, if it has one; else the system's temporary directory).
    :class:`~rollsafe.errors.EnvUnavailable`: unreachable at all;
    :class:`~rollsafe.errors.InvalidInput`: it refuses the token (401), or the task is too
    short. Nothing to check."""
    began, results = time.monotonic(), []
    engine = None
    if engine_url is not None:
        engine = EngineClient(engine_url, engine_token or "", timeout=15.0)
    r = Run(url, token, task, lease_wait_s, engine, snapshot_root)
    try:
        try:
            first = await r.raw("status")
        except httpx.RequestError as exc:
            raise EnvUnavailable(f"environment at {url}: unreachable: {exc!r}") from None
        if first.status_code == 401:
            raise InvalidInput(f"environment at {url} refused the token (401): {first.text}")
        await probe(r)
        for fn in CHECKS:
            results.append(c := await _check(r, fn))
            mark = "SKIP" if c.skipped else "PASS" if c.passed else "FAIL"
            if progress is not None:
                progress(f"{mark} {c.name} ({c.seconds:.1f}s): {c.detail}")
    finally:
        await r.env.aclose()
        await r.http.aclose()
        if engine is not None:
            await engine.aclose()
        shutil.rmtree(r.root, ignore_errors=True)
    passed, seconds = all(x.passed for x in results), time.monotonic() - began
    return ConformanceReport(
        url=url,
        instance=r.instance or None,
        passed=passed,
        seconds=seconds,
        checks=tuple(results),
        not_compared=tuple(sorted(r.not_compared)),
        not_verified=tuple(sorted(r.not_verified)),
    )
