"""A conformance suite for any server speaking the checkpoint protocol (``/checkpoint/v1``).

Each check returns a detail line or raises :class:`CheckFailed`, and leaves the instance idle.
Ids are fresh. Commit files are verified here when the URL is a loopback one (else missing
files are a warning). An episode parked ``generating`` must stay committable even though this
suite cuts no engine call: a conforming server holds a response that arrives while parked."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeAlias
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field

from rollsafe.env import protocol as w
from rollsafe.env import store
from rollsafe.env.client import EnvClient, EnvRefused, EpisodeParked
from rollsafe.errors import EnvUnavailable, InvalidInput

EPISODE_S = 120.0  # one episode's time limit
Headers = dict[str, str]
Reply: TypeAlias = httpx.Response
Tasks = dict[str, asyncio.Task[w.EpisodeResult]]


class CheckResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    passed: bool
    detail: str
    seconds: float = Field(ge=0)
    skipped: bool = Field(default=False, description="not applicable here; counts as passed")


class ConformanceReport(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    instance: str | None
    passed: bool = Field(description="every check passed (or was skipped)")
    seconds: float = Field(ge=0)
    checks: tuple[CheckResult, ...]


class CheckFailed(Exception): ...  # an expectation did not hold; the message says which


class _Skip(Exception): ...  # the check does not apply here; the message says why


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


def _prep(cid: str, in_s: float = 10.0) -> w.PrepareRequest:
    return w.PrepareRequest(checkpoint_id=cid, deadline_ts=time.time() + in_s)


class _Run:
    """One suite run against one instance: clients, fresh ids, and what to clean up."""

    def __init__(self, url: str, token: str, task: dict[str, Any] | None, wait_s: float) -> None:
        self.task, self.lease_wait_s, self.auth = task, wait_s, {"authorization": f"Bearer {token}"}
        self.root = Path(tempfile.mkdtemp(prefix="rollsafe-conformance-"))
        self.local_files = urlsplit(url).hostname in ("localhost", "127.0.0.1", "::1")
        self.env = EnvClient(url, token, timeout_s=15.0)
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=15.0)
        self.tag, self.count, self.instance = uuid.uuid4().hex[:8], 0, ""
        self.opened: list[str] = []
        self.retired: list[w.EpisodeRef] = []
        self.running: Tasks = {}

    def new_id(self) -> str:
        self.opened.append(cid := f"conf-{uuid.uuid4().hex}")  # resumed when the check ends
        return cid

    def new_ref(self) -> w.EpisodeRef:
        self.count += 1
        return w.EpisodeRef(rollout_id=f"conf-{self.tag}-{self.count}_g0", attempt=0)

    def new_dir(self) -> Path:
        return Path(tempfile.mkdtemp(dir=self.root))

    def run(self, ref: w.EpisodeRef, timeout_s: float = EPISODE_S) -> Awaitable[w.EpisodeResult]:
        run = w.RunEpisode(episode=ref, task=self.task or {})
        return self.env.run_episode(run, timeout_s=timeout_s)

    async def commit(self, cid: str, scope: tuple[w.EpisodeRef, ...], dest: Path) -> w.CommitReply:
        body = w.CommitRequest(checkpoint_id=cid, scope=scope, dest=str(dest))
        return await self.env.commit(body)

    async def resume(self, cid: str) -> w.ResumeReply:
        return await self.env.resume(w.ResumeRequest(checkpoint_id=cid))

    async def raw(self, op: str, body: bytes | None = None, head: Headers | None = None) -> Reply:
        path = w.EPISODES_RUN if op == "run" else f"{w.PREFIX}/{op}"
        method, sent = "GET" if op == "status" else "POST", self.auth if head is None else head
        return await self.http.request(method, path, content=body, headers=sent)

    async def idle(self) -> w.StatusReply:
        status = await self.env.status()
        expect(status.phase == "idle", f"status is {status.phase} ({status.checkpoint_id})")
        return status

    async def finish(self, tasks: Tasks, within: float, when: str) -> list[w.EpisodeResult]:
        if tasks:
            await asyncio.wait(tasks.values(), timeout=within)
        late = sorted(k for k, t in tasks.items() if not t.done())
        expect(not late, f"{', '.join(late)} did not finish within {within:.0f}s {when}")
        return [t.result() for t in tasks.values()]

    async def refused(self, call: Awaitable[object], reason: str | None, what: str) -> str:
        try:
            await call
        except (EnvRefused, EpisodeParked) as exc:
            expect(reason in (None, exc.reason), f"{what}: 409 {exc.reason}, want {reason}")
            return exc.reason
        raise CheckFailed(f"{what}: accepted, want 409 {reason or ''}")

    async def cleanup(self) -> str | None:
        """Resume, forget, await episodes; a problem if the instance is then not idle."""
        undo: list[Awaitable[object]] = [self.resume(cid) for cid in self.opened]
        if self.retired:
            undo.append(self.env.forget(w.ForgetRequest(rollouts=tuple(self.retired))))
        every = asyncio.gather(*undo, *self.running.values(), return_exceptions=True)
        with suppress(TimeoutError):  # errors: the check reported them; late episodes: cancelled
            await asyncio.wait_for(every, 30)
        self.opened, self.retired, self.running = [], [], {}
        status = await self.env.status()
        return None if status.phase == "idle" else f"left it {status.phase} {status.checkpoint_id}"


async def _park_commit(r: _Run, n: int) -> tuple[str, w.PrepareReply, w.CommitReply, Path]:
    """Start ``n`` episodes (given a task); once live, prepare, commit the parked ones at once,
    check that those not listed end by themselves. Leaves the instance committed; returns the
    id, the replies and the dest."""
    running: Tasks = {}
    if r.task is not None:
        refs = [r.new_ref() for _ in range(n)]
        r.running = running = {ref.key: asyncio.ensure_future(r.run(ref)) for ref in refs}
    until = time.monotonic() + 10
    while (await r.env.status()).live_episodes < sum(not t.done() for t in running.values()):
        await asyncio.gather(*(t for t in running.values() if t.done()))  # raises a refusal
        expect(time.monotonic() < until, f"status never counted {n} live episodes")
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)  # so they are mid-episode
    cid, dest = r.new_id(), r.new_dir()
    prep = await r.env.prepare(_prep(cid))
    expect(prep.ready, f"prepare {cid} not ready: {'; '.join(prep.blockers)}")
    parked = [p for p in prep.parked if p.episode.key in running]
    commit = await r.commit(cid, scope := tuple(p.episode for p in parked), dest)
    expect(commit.committed == scope, f"committed {commit.committed}, not {scope}")
    listed = {p.episode.key for p in prep.parked} | {e.key for e in prep.restarts}
    unlisted = {k: t for k, t in running.items() if k not in listed}
    await r.finish(unlisted, 10, "while committed, yet prepare did not list them as parked")
    return cid, prep, commit, dest


def _verify_files(r: _Run, dest: Path, cid: str, commit: w.CommitReply) -> str:
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


async def status_shape(r: _Run) -> str:
    reply = await r.raw("status")
    expect(reply.status_code == 200, f"status answered {reply.status_code}: {reply.text[:200]}")
    status = w.StatusReply.model_validate_json(reply.content)
    expect(status.phase == "idle" and status.checkpoint_id is None, f"not idle: {status}")
    r.instance = status.instance
    return f"instance {status.instance}, participants {', '.join(status.participants)}"


async def auth(r: _Run) -> str:
    before, cid = await r.idle(), r.new_id()  # resumed at the end, should a 401 prepare open it
    body = _prep(cid).model_dump_json()
    for label, headers in (("a wrong", {"authorization": "Bearer conf-wrong"}), ("no", {})):
        for op in ("status", "prepare"):
            reply = await r.raw(op, body.encode() if op == "prepare" else None, headers)
            expect(reply.status_code == 401, f"{op} with {label} token: {reply.status_code}")
    expect((await r.idle()).retired == before.retired, "a refused request changed the status")
    await r.env.prepare(_prep(cid))  # the refused prepare left its id usable
    return "401 on status and prepare for a wrong and a missing token; nothing changed"


async def malformed_bodies(r: _Run) -> str:
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


async def prepare_commit_resume(r: _Run) -> str:
    cid, prep, commit, dest = await _park_commit(r, 3)
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


async def idempotent_replay(r: _Run) -> str:
    cid, dest = r.new_id(), r.new_dir()
    first = await r.env.prepare(request := _prep(cid))
    expect(await r.env.prepare(request) == first, "a repeated prepare replied differently")
    done = await r.commit(cid, (), dest)
    expect(await r.commit(cid, (), dest) == done, "a repeated commit replied differently")
    once, twice = await r.resume(cid), await r.resume(cid)
    expect(once.resumed and twice == once, f"resume replied {once}, then {twice}")
    return f"prepare, commit (sha256 {done.participants[0].sha256[:12]}) and resume replayed"


async def resumed_id_refused(r: _Run) -> str:
    cid = r.new_id()
    await r.env.prepare(_prep(cid))
    await r.resume(cid)
    await r.refused(r.env.prepare(_prep(cid)), "checkpoint_resumed", "prepare again")
    renew = w.RenewRequest(checkpoint_id=cid, deadline_ts=time.time() + 10)
    await r.refused(r.env.renew(renew), "checkpoint_resumed", "renew after resume")
    return "prepare and renew of a resumed id: 409 checkpoint_resumed"


async def wrong_phase(r: _Run) -> str:
    a, b = r.new_id(), r.new_id()
    idle = await r.refused(r.commit(r.new_id(), (), r.new_dir()), None, "commit before prepare")
    await r.env.prepare(_prep(a))
    r.retired.append(ref := r.new_ref())
    await r.refused(r.env.retire(w.RetireRequest(rollouts=(ref,))), "wrong_phase", "retire")
    await r.refused(r.env.prepare(_prep(b)), "other_checkpoint", "a second prepare")
    await r.refused(r.commit(b, (), r.new_dir()), "other_checkpoint", "commit of another id")
    other, status = await r.resume(b), await r.env.status()
    expect(not other.resumed and status.checkpoint_id == a, f"resume of {b} touched {a}")
    return f"commit while idle: 409 {idle}; retire, other checkpoint ids refused while prepared"


async def retire_forget(r: _Run) -> str:
    r.retired.append(ref := r.new_ref())
    retired = await r.env.retire(w.RetireRequest(rollouts=(ref,)))
    expect(retired.count == 1 and (await r.idle()).retired >= 1, f"retire counted {retired}")
    await r.refused(r.run(ref, 10), "retired", "running a retired episode")
    forgot = await r.env.forget(w.ForgetRequest(rollouts=(ref,)))
    expect(forgot.count == 1, f"forget counted {forgot.count}, want 1")
    result = await r.run(ref)
    return f"retired episode refused; after forget it ran {result.turns} turns"


async def restore(r: _Run) -> str:
    cid, prep, commit, dest = await _park_commit(r, 2)
    if not commit.committed:
        expect(not prep.parked and bool(prep.restarts), "no episode parked: a longer task?")
        raise _Skip("the instance parked no episode (restarts only): nothing to restore")
    await r.resume(cid)
    await r.finish(r.running, EPISODE_S, "after resume")
    rid, nexts = r.new_id(), tuple(e.next_attempt() for e in commit.committed)
    source = {"source_checkpoint_id": cid, "root": str(dest), "scope": commit.committed}
    request = {"restore_id": rid, "deadline_ts": time.time() + 30, **source}
    reply = await r.env.restore(w.RestoreRequest.model_validate(request))
    expect(reply.restored == nexts, f"restore listed {reply.restored}, want {nexts}")
    status = await r.env.status()
    expect((status.phase, status.checkpoint_id) == ("restored", rid), f"status: {status}")
    await r.refused(r.run(nexts[0], 5), "checkpoint_parked", "attempt n+1 before resume")
    expect((await r.resume(rid)).resumed, f"resume of restore {rid} did not resume it")
    results = await asyncio.gather(*(r.run(ep) for ep in nexts))
    expect(all(x.restored for x in results), "a restored attempt says restored=False")
    return f"restored {', '.join(e.key for e in nexts)}; each continued to its end"


async def lease_expiry(r: _Run) -> str:
    if r.lease_wait_s <= 0:
        raise _Skip("lease_wait_s is 0: not waiting for a lease to run out")
    cid, deadline = r.new_id(), time.time() + 1
    prep = await r.env.prepare(w.PrepareRequest(checkpoint_id=cid, deadline_ts=deadline))
    while (status := await r.env.status()).phase != "idle":
        late = time.time() - deadline
        expect(late < r.lease_wait_s + 0.5, f"still {status.phase} {late:.1f}s past the deadline")
        await asyncio.sleep(0.1)
    late, grace = time.time() - deadline, prep.lease_expires_ts - deadline
    await r.refused(r.env.prepare(_prep(cid)), "checkpoint_resumed", "preparing the expired id")
    return f"idle {late:.1f}s past the deadline (lease grace {grace:.1f}s); the id is refused"


Check = Callable[[_Run], Awaitable[str]]
CHECKS: tuple[Check, ...] = (status_shape, auth, malformed_bodies, prepare_commit_resume)
CHECKS += (idempotent_replay, resumed_id_refused, wrong_phase, retire_forget, restore, lease_expiry)
NEEDS_TASK = (retire_forget, restore)


async def _check(r: _Run, fn: Check) -> CheckResult:
    began, skipped = time.monotonic(), False
    try:
        if fn in NEEDS_TASK and r.task is None:
            raise _Skip("no task given: needs episodes")
        detail, passed = await fn(r), True  # every call and wait in it has a time limit
    except _Skip as exc:
        detail, passed, skipped = str(exc), True, True
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
    task: dict[str, Any] | None = None,
    lease_wait_s: float = 60.0,
    progress: Callable[[str], None] | None = None,
) -> ConformanceReport:
    """Run every check against the (idle) instance at ``url``, in turn, reporting each done
    one to ``progress``. :class:`~rollsafe.errors.EnvUnavailable`: unreachable at all;
    :class:`~rollsafe.errors.InvalidInput`: it refuses the token (401). Nothing to check."""
    began, results = time.monotonic(), []
    r = _Run(url, token, task, lease_wait_s)
    try:
        try:
            first = await r.raw("status")
        except httpx.RequestError as exc:
            raise EnvUnavailable(f"environment at {url}: unreachable: {exc!r}") from None
        if first.status_code == 401:
            raise InvalidInput(f"environment at {url} refused the token (401): {first.text}")
        for fn in CHECKS:
            results.append(c := await _check(r, fn))
            mark = "SKIP" if c.skipped else "PASS" if c.passed else "FAIL"
            if progress is not None:
                progress(f"{mark} {c.name} ({c.seconds:.1f}s): {c.detail}")
    finally:
        await r.env.aclose()
        await r.http.aclose()
        shutil.rmtree(r.root, ignore_errors=True)
    passed, seconds = all(x.passed for x in results), time.monotonic() - began
    return ConformanceReport(
        url=url, instance=r.instance or None, passed=passed, seconds=seconds, checks=tuple(results)
    )
