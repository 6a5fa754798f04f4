"""Fault switches for tests: a thin ASGI middleware around the toolkit's app, so the toolkit
itself carries no test code.

Switches (``--faults`` or ``ROLLSAFE_ENV_FAULTS`` at start, a comma-separated spec such as
``slow_prepare:2.0,unavailable,die_on:commit,lose_resume,stale_checkpoint``; at runtime
``POST /faults`` with a :class:`FaultSwitches` body and the instance's bearer token, which
replaces every switch; ``GET /faults`` reads them):

``slow_prepare:S``   sleep S seconds before the toolkit sees a prepare
``slow_run:S``       sleep S seconds before the toolkit sees an ``/episodes/run`` (its episodes
                     start, and finish, later than the other instances')
``unavailable``      503 ``EnvUnavailable`` for every ``/checkpoint/v1`` endpoint
``die_on:OP``        ``os._exit(137)`` when OP arrives, before the toolkit sees it
``die_after:OP``     ``os._exit(137)`` after the toolkit did OP, before its reply goes out
``lose_resume``      a resume is answered ``resumed: true`` but never reaches the toolkit:
                     the instance stays parked until its lease runs out
``stale_checkpoint`` status names an older checkpoint id than the instance's own (the one
                     before it, or ``stale-checkpoint`` if there was none)

OP is one of :data:`FAULT_OPS`: a checkpoint endpoint's name, or ``run`` for ``/episodes/run``.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollsafe.env.protocol import EPISODES_RUN, PREFIX, ErrorReply, ResumeReply
from rollsafe.errors import InvalidInput
from rollsafe.http.bearer import token_matches, unauthorized
from rollsafe.reference.envs.workplace.calendar import describe

ENV_VAR = "ROLLSAFE_ENV_FAULTS"
EXIT_CODE = 137  # what a kill -9 looks like, as rollsafe.faults does
STALE_ID = "stale-checkpoint"
FaultOp = Literal[
    "status", "prepare", "renew", "commit", "resume", "retire", "forget", "restore", "run"
]
FAULT_OPS: tuple[str, ...] = get_args(FaultOp)


class FaultSwitches(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    slow_prepare: float = Field(default=0.0, ge=0.0, le=600.0)
    slow_run: float = Field(default=0.0, ge=0.0, le=600.0)
    unavailable: bool = False
    die_on: FaultOp | None = None
    die_after: FaultOp | None = None
    lose_resume: bool = False
    stale_checkpoint: bool = False


def parse_faults(spec: str) -> FaultSwitches:
    """Switches from a spec string; an unknown switch or bad value is :class:`InvalidInput`."""
    fields: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition(":")
        if name not in FaultSwitches.model_fields:
            known = ", ".join(FaultSwitches.model_fields)
            raise InvalidInput(f"unknown fault switch {name!r} (known: {known})")
        fields[name] = value if value else True
    try:
        return FaultSwitches.model_validate(fields)
    except ValidationError as exc:
        raise InvalidInput(f"bad fault spec {spec!r}: {describe(exc)}") from None


def _op(path: str) -> str | None:
    if path == EPISODES_RUN:
        return "run"
    if path.startswith(PREFIX + "/"):
        name = path[len(PREFIX) + 1 :]
        return name if name in FAULT_OPS else None
    return None


class FaultMiddleware:
    """Wraps the toolkit's app; with every switch off it only passes requests through."""

    def __init__(
        self,
        app: ASGIApp,
        token: str,
        switches: FaultSwitches | None = None,
        *,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.app = app
        self.switches = switches or FaultSwitches()
        self._token = token
        self._exit = exit
        self._seen: list[str] = []  # checkpoint and restore ids, oldest first

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # noqa: C901 (one branch per fault kind)
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/faults":
            await self._faults(scope, receive, send)
            return
        op, s = _op(scope["path"]), self.switches
        if op is None or not self._authorized(scope):  # refused by the app: nothing fires
            await self.app(scope, receive, send)
            return
        if op == s.die_on:
            self._exit(EXIT_CODE)
        if s.unavailable and op != "run":
            error = ErrorReply(error="EnvUnavailable", detail="injected fault: unavailable")
            await JSONResponse(error.model_dump(), status_code=503)(scope, receive, send)
            return
        if op in ("prepare", "restore"):
            receive = await self._note_id(receive)
        if op == "prepare" and s.slow_prepare:
            await asyncio.sleep(s.slow_prepare)
        if op == "run" and s.slow_run:
            await asyncio.sleep(s.slow_run)
        if op == "resume" and s.lose_resume:
            reply = ResumeReply(phase="idle", resumed=True)
            await JSONResponse(reply.model_dump())(scope, receive, send)
            return
        if op == s.die_after:
            send = self._dying(send)
        elif op == "status" and s.stale_checkpoint:
            send = self._stale(send)
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        return token_matches(given, self._token)

    async def _faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._authorized(scope):
            await unauthorized()(scope, receive, send)
            return
        if scope["method"] == "POST":
            try:
                self.switches = FaultSwitches.model_validate_json(await _body(receive))
            except ValidationError as exc:
                error = ErrorReply(error="InvalidInput", detail=str(exc))
                await JSONResponse(error.model_dump(), status_code=422)(scope, receive, send)
                return
        await JSONResponse(self.switches.model_dump())(scope, receive, send)

    async def _note_id(self, receive: Receive) -> Receive:
        """Remember the request's checkpoint (or restore) id; the toolkit reads the same body."""
        body = await _body(receive)
        try:
            fields = json.loads(body)
            given = fields.get("checkpoint_id") or fields.get("restore_id")
        except (ValueError, AttributeError):
            given = None  # malformed: the toolkit answers 422
        if isinstance(given, str) and (not self._seen or self._seen[-1] != given):
            self._seen.append(given)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:  # the body was read: what follows is the client going away, or nothing
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay

    def _dying(self, send: Send) -> Send:
        async def dying(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._exit(EXIT_CODE)
            await send(message)

        return dying

    def _stale(self, send: Send) -> Send:
        start: Message | None = None
        chunks: list[bytes] = []

        async def stale(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False) or start is None:
                return
            body = b"".join(chunks)
            if start["status"] == 200:
                reply = json.loads(body)
                reply["checkpoint_id"] = self._older(reply.get("checkpoint_id"))
                body = json.dumps(reply).encode()
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        return stale

    def _older(self, current: str | None) -> str:
        older = [c for c in self._seen if c != current]
        return older[-1] if older else STALE_ID


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
