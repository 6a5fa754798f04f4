"""One environment instance over the checkpoint protocol (docs/design.md section 7), as typed calls.

:class:`EnvClient` speaks :mod:`rollsafe.env.protocol` to one instance and turns every failure
into a rollsafe error that says which instance and which operation:

===============================================  ==============================================
what happened                                    raised
===============================================  ==============================================
no connection, no reply by the deadline, 5xx     :class:`~rollsafe.errors.EnvUnavailable`
409 ``checkpoint_parked``                        :class:`EpisodeParked` (transient: re-send)
409 any other reason (``retired``, ...)          :class:`EnvRefused` with ``.reason``
401                                              :class:`~rollsafe.errors.InvalidInput` (token)
422 and other 4xx                                :class:`~rollsafe.errors.InvalidInput`
a 200 reply that is not protocol v1              :class:`~rollsafe.errors.SchemaMismatch`
===============================================  ==============================================

A reply that does not validate is a :class:`~rollsafe.errors.SchemaMismatch` (an invariant,
not retried): the instance answered, so retrying the same call gets the same wrong answer.

Deadlines cover a whole call, not each read: a control call gets ``timeout_s + grace_s``;
``prepare`` and ``restore`` carry their own ``deadline_ts`` and get until ``deadline_ts +
grace_s`` (``restore`` at least ``timeout_s + grace_s``), because the instance is allowed to
work until the deadline and the grace covers the reply's trip back.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from rollsafe import errors
from rollsafe.env.protocol import (
    EPISODES_RUN,
    PREFIX,
    PROTOCOL_VERSION,
    CommitReply,
    CommitRequest,
    CountReply,
    EffectsReply,
    EffectsRequest,
    EpisodeResult,
    ErrorReply,
    ForgetRequest,
    LeaseReply,
    PrepareReply,
    PrepareRequest,
    RenewReply,
    RenewRequest,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    RetireRequest,
    RunEpisode,
    RunLease,
    StatusReply,
)
from rollsafe.errors import (
    EnvRefused,
    EnvUnavailable,
    EpisodeParked,
    InvalidInput,
    RollsafeError,
    SchemaMismatch,
)
from rollsafe.http.client import http_client

R = TypeVar("R", bound=BaseModel)
_JSON = {"content-type": "application/json"}
PARKED = "checkpoint_parked"


class EnvClient:
    """The environment checkpoint protocol against ONE instance, raising rollsafe errors."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout_s: float = 10.0,
        grace_s: float = 2.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not token:
            raise InvalidInput(f"environment at {base_url}: a client needs a non-empty token")
        if timeout_s <= 0 or grace_s < 0:
            raise InvalidInput(
                f"timeout_s must be > 0 and grace_s >= 0, not {timeout_s}, {grace_s}"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self._http = http_client(self.base_url, token, transport=transport)

    # -- checkpoint control ---------------------------------------------------------------------

    async def status(self) -> StatusReply:
        return await self._control("status", None, StatusReply)

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        budget = self._until(request.deadline_ts)
        return await self._control("prepare", request, PrepareReply, budget)

    async def renew(self, request: RenewRequest) -> RenewReply:
        return await self._control("renew", request, RenewReply)

    async def commit(self, request: CommitRequest) -> CommitReply:
        return await self._control("commit", request, CommitReply)

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        return await self._control("resume", request, ResumeReply)

    async def retire(self, request: RetireRequest) -> CountReply:
        return await self._control("retire", request, CountReply)

    async def forget(self, request: ForgetRequest) -> CountReply:
        return await self._control("forget", request, CountReply)

    async def restore(self, request: RestoreRequest) -> RestoreReply:
        # Reading records back can take longer than a control call, and never less.
        budget = max(self._until(request.deadline_ts), self.timeout_s + self.grace_s)
        return await self._control("restore", request, RestoreReply, budget)

    async def effects(self, request: EffectsRequest) -> EffectsReply:
        return await self._control("effects", request, EffectsReply)

    async def lease(self, request: RunLease) -> LeaseReply:
        return await self._control("lease", request, LeaseReply)

    # -- episodes -------------------------------------------------------------------------------

    async def run_episode(
        self, run: RunEpisode, *, timeout_s: float | None = None
    ) -> EpisodeResult:
        """Drive one episode to its end. ``timeout_s`` bounds the whole episode (None: no
        bound, only the connect); a 409 ``checkpoint_parked`` raises :class:`EpisodeParked`."""
        content = await self._send("run_episode", "POST", EPISODES_RUN, run, timeout_s)
        return self._parse("run_episode", EpisodeResult, content)

    # -- lifecycle ------------------------------------------------------------------------------

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"EnvClient({self.base_url!r})"

    # -- plumbing -------------------------------------------------------------------------------

    def _until(self, deadline_ts: float) -> float:
        return max(deadline_ts - time.time(), 0.0) + self.grace_s

    async def _control(
        self, op: str, body: BaseModel | None, reply: type[R], budget: float | None = None
    ) -> R:
        seconds = self.timeout_s + self.grace_s if budget is None else budget
        method = "GET" if body is None else "POST"
        content = await self._send(op, method, f"{PREFIX}/{op}", body, seconds)
        return self._parse(op, reply, content)

    async def _send(
        self, op: str, method: str, path: str, body: BaseModel | None, seconds: float | None
    ) -> bytes:
        content = body.model_dump_json() if body is not None else None
        # httpx's timeout bounds each read; asyncio.timeout bounds the whole call, so a server
        # that trickles bytes (or a transport that ignores timeouts) still meets the deadline.
        timeout = httpx.Timeout(seconds, connect=self.timeout_s if seconds is None else seconds)
        try:
            async with asyncio.timeout(seconds):
                response = await self._http.request(
                    method, path, content=content, headers=_JSON, timeout=timeout
                )
        except (TimeoutError, httpx.TimeoutException):
            raise EnvUnavailable(
                f"environment at {self.base_url}: {op} got no reply within {seconds:.2f}s"
            ) from None
        except httpx.RequestError as exc:
            raise EnvUnavailable(
                f"environment at {self.base_url}: {op} unreachable: {exc!r}"
            ) from exc
        if response.status_code != 200:
            raise self._error(op, response.status_code, response.content)
        return response.content

    def _parse(self, op: str, model: type[R], content: bytes) -> R:
        try:
            return model.model_validate_json(content)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "(body)"
            raise SchemaMismatch(
                f"environment at {self.base_url}: {op} reply is not protocol "
                f"v{PROTOCOL_VERSION} {model.__name__} ({exc.error_count()} error(s); "
                f"{where}: {first['msg']})"
            ) from None

    def _error(self, op: str, status: int, content: bytes) -> RollsafeError:
        reason, detail = _error_fields(status, content)
        where = f"environment at {self.base_url}: {op}"
        if status == 401:
            return InvalidInput(f"{where}: the instance refused the token: {detail}")
        if status == 409:
            cls = EpisodeParked if reason == PARKED else EnvRefused
            return cls(self.base_url, op, reason, detail)
        if status == 422:
            return InvalidInput(f"{where}: malformed request ({reason}): {detail}")
        if status == 500:  # retried like any 5xx, but said for what it is
            return EnvUnavailable(
                f"{where}: server error, a bug in the environment ({reason}): {detail}"
            )
        if status >= 500:
            return EnvUnavailable(f"{where}: unavailable ({status} {reason}): {detail}")
        return InvalidInput(f"{where}: refused ({status} {reason}): {detail}")


def _error_fields(status: int, content: bytes) -> tuple[str, str]:
    try:
        reply = ErrorReply.model_validate_json(content)
    except ValidationError:  # not the protocol's: a proxy's page, say
        return f"HTTP {status}", content[:200].decode(errors="replace")
    return reply.error, reply.detail


def rebuild_with_fields(template: RollsafeError, message: str) -> RollsafeError:
    """An error of ``template``'s class and fields with a new message (a fleet's summary keeps
    the class a caller or the Temporal boundary branches on, and e.g. a refusal's reason)."""
    error = errors._rebuild(type(template), message)
    fields: dict[str, Any] = {k: v for k, v in vars(template).items() if k != "__notes__"}
    error.__dict__.update(fields)
    return error
