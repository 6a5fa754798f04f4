"""One conformance suite run against one instance (:mod:`rollsafe.env.conformance`): its
clients, fresh ids, what it cleans up, and parking episodes for the checks that need them."""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeAlias
from urllib.parse import urlsplit

import httpx

from rollsafe.engine.protocol import Engine
from rollsafe.env import protocol as w
from rollsafe.env.client import EnvClient
from rollsafe.errors import EnvRefused, EpisodeParked
from rollsafe.http.client import http_client

EPISODE_S = 120.0  # one episode's time limit
MIN_TASK_TURNS = 3  # turns the task must run: an episode must park after its first
Headers = dict[str, str]
Reply: TypeAlias = httpx.Response
Tasks = dict[str, asyncio.Task[w.EpisodeResult]]
# Whether a prepared checkpoint parked what a check needs (else it is resumed and retried).
Wanted = Callable[[w.PrepareReply], Awaitable[bool]]


class CheckFailed(Exception): ...  # an expectation did not hold; the message says which


class Skip(Exception): ...  # the check does not apply here; the message says why


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


def prep_request(cid: str, in_s: float = 10.0) -> w.PrepareRequest:
    return w.PrepareRequest(checkpoint_id=cid, deadline_ts=time.time() + in_s)


class Run:
    """One suite run against one instance: clients, fresh ids, and what to clean up."""

    def __init__(
        self,
        url: str,
        token: str,
        task: dict[str, Any],
        wait_s: float,
        engine: Engine | None = None,
        snapshot_root: Path | None = None,
    ) -> None:
        self.task, self.lease_wait_s, self.auth = task, wait_s, {"authorization": f"Bearer {token}"}
        self.engine = engine  # the instance's policy engine, to cut a call; None: not given
        self.root = Path(tempfile.mkdtemp(prefix="rollsafe-conformance-", dir=snapshot_root))
        self.local_files = urlsplit(url).hostname in ("localhost", "127.0.0.1", "::1")
        self.env = EnvClient(url, token, timeout_s=15.0)
        self.http = http_client(url, None, timeout=15.0)  # each request sends its own auth
        self.tag, self.count, self.instance = uuid.uuid4().hex[:8], 0, ""
        self.turn_s = 0.05  # seconds a turn takes (measured by the probe episode)
        self.opened: list[str] = []
        self.retired: list[w.EpisodeRef] = []
        self.frozen: list[str] = []  # calls this run cut on the engine: released at cleanup
        self.running: Tasks = {}
        self.probe: w.EpisodeResult | None = None  # the task's first episode, uninterrupted
        self.not_compared: set[str] = set()  # what the checks could not compare, and why
        self.not_verified: set[str] = set()  # what matters of those: "effects", "state"
        self.attempt_info: tuple[str, ...] = ()  # info's paths the environment declares

    def new_id(self) -> str:
        self.opened.append(cid := f"conf-{uuid.uuid4().hex}")  # resumed when the check ends
        return cid

    def new_ref(self) -> w.EpisodeRef:
        self.count += 1
        return w.EpisodeRef(rollout_id=f"conf-{self.tag}-{self.count}_g0", attempt=0)

    def new_dir(self) -> Path:
        return Path(tempfile.mkdtemp(dir=self.root))

    def run(self, ref: w.EpisodeRef, timeout_s: float = EPISODE_S) -> Awaitable[w.EpisodeResult]:
        """Run an episode of the task, audited (its effects, calls and state digests)."""
        run = w.RunEpisode(episode=ref, task=self.task, audit=True)
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
        if self.frozen and self.engine is not None:
            undo.append(self.engine.release(self.frozen))
        every = asyncio.gather(*undo, *self.running.values(), return_exceptions=True)
        with suppress(TimeoutError):  # errors: the check reported them; late episodes: cancelled
            await asyncio.wait_for(every, 30)
        self.opened, self.retired, self.running, self.frozen = [], [], {}, []
        status = await self.env.status()
        return None if status.phase == "idle" else f"left it {status.phase} {status.checkpoint_id}"


async def park_commit(
    r: Run, n: int, wanted: Wanted | None = None
) -> tuple[str, w.PrepareReply, w.CommitReply, Path]:
    """Start ``n`` episodes of the task; once live, prepare (until ``wanted`` says it
    parked what the check needs), commit the parked ones at once, check that those not listed
    end by themselves. Leaves the instance committed; returns the id, the replies, the dest."""
    refs = [r.new_ref() for _ in range(n)]
    r.running = running = {ref.key: asyncio.ensure_future(r.run(ref)) for ref in refs}
    until = time.monotonic() + 10
    while (await r.env.status()).live_episodes < sum(not t.done() for t in running.values()):
        await asyncio.gather(*(t for t in running.values() if t.done()))  # raises a refusal
        expect(time.monotonic() < until, f"status never counted {n} live episodes")
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)  # so they are mid-episode
    cid, prep = await prepared(r, running, wanted)
    dest = r.new_dir()
    parked = [p for p in prep.parked if p.episode.key in running]
    commit = await r.commit(cid, scope := tuple(p.episode for p in parked), dest)
    expect(commit.committed == scope, f"committed {commit.committed}, not {scope}")
    listed = {p.episode.key for p in prep.parked} | {e.key for e in prep.restarts}
    unlisted = {k: t for k, t in running.items() if k not in listed}
    await r.finish(unlisted, 10, "while committed, yet prepare did not list them as parked")
    return cid, prep, commit, dest


async def prepared(r: Run, running: Tasks, wanted: Wanted | None) -> tuple[str, w.PrepareReply]:
    """A prepared checkpoint; until ``wanted`` accepts it, resumed and prepared again half a
    turn later each time."""
    deadline = time.monotonic() + EPISODE_S
    while True:
        cid = r.new_id()
        prep = await r.env.prepare(prep_request(cid))
        expect(prep.ready, f"prepare {cid} not ready: {'; '.join(prep.blockers)}")
        if wanted is None or await wanted(prep):
            return cid, prep
        await r.resume(cid)
        if all(t.done() for t in running.values()):
            await asyncio.gather(*running.values())  # an episode that failed: its own error
        expect(
            not all(t.done() for t in running.values()),
            "every episode ended, each successfully, before one was parked as this check "
            f"needs: give a longer task (at least {MIN_TASK_TURNS} turns)",
        )
        expect(time.monotonic() < deadline, f"nothing parked as needed in {EPISODE_S:.0f}s")
        await asyncio.sleep(r.turn_s / 2)
