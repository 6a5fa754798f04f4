"""The checkpoint protocol over HTTP: a :class:`~rollsafe.env.participant.Participant` served
as a Starlette app (or as routes to mount on an environment server's own app).

Every endpoint wants ``Authorization: Bearer <token>``; a wrong or missing token is a 401 that
changes nothing. Bodies are parsed with the protocol models. Errors are
:class:`~rollsafe.env.protocol.ErrorReply`:

=====  ========================================================================================
401    ``Unauthorized``
409    :class:`~rollsafe.env.participant.Refused` (``error`` = its reason: ``checkpoint_parked``,
       ``retired``, ``wrong_phase``, ...), or an invariant error (``SnapshotCorrupt``,
       ``OwnershipMismatch``: the request is well formed but what it names on disk is not)
422    a malformed body (``detail`` names the field) or other ``InvalidInput``
503    a transient error (``EnvUnavailable``, ``EnvNotReady``, ...)
500    anything else: a bug
=====  ========================================================================================
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rollsafe.env import protocol as wire
from rollsafe.env.participant import Participant
from rollsafe.errors import InvalidInput, InvariantError, ParticipantRefused, TransientError
from rollsafe.http.bearer import Handler, guarded
from rollsafe.http.contract import ContractHeaders
from rollsafe.http.tracing import ServerSpans

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger(__name__)


def _error(status: int, error: str, detail: str) -> Response:
    body = wire.ErrorReply(error=error, detail=detail).model_dump_json()
    return Response(body, status_code=status, media_type="application/json")


def error_response(exc: Exception) -> Response:
    """The typed reply for an error raised while serving a request."""
    if isinstance(exc, ParticipantRefused):
        return _error(409, exc.reason, str(exc))
    if isinstance(exc, InvalidInput):
        return _error(422, type(exc).__name__, str(exc))
    if isinstance(exc, InvariantError):
        return _error(409, type(exc).__name__, str(exc))
    if isinstance(exc, TransientError):
        return _error(503, type(exc).__name__, str(exc))
    log.exception("checkpoint endpoint failed", exc_info=exc)
    return _error(500, type(exc).__name__, str(exc))


def field_problems(exc: ValidationError) -> str:
    """Each problem as ``field.path: message`` (``<body>`` when the body itself is wrong)."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or '<body>'}: {e['msg']}" for e in exc.errors()[:10]
    )


async def _parse(request: Request, model: type[M]) -> M:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        # InvalidInput by name, so a client can rebuild it from rollsafe.errors.
        raise InvalidInput(f"{model.__name__}: {field_problems(exc)}") from None


def _reply(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _guarded(token: str, handler: Handler) -> Handler:
    return guarded(token, handler, error_response)


def _post(model: type[M], call: Callable[[M], Awaitable[BaseModel]]) -> Handler:
    async def handler(request: Request) -> Response:
        return _reply(await call(await _parse(request, model)))

    return handler


def _answered(call: Callable[[M], BaseModel]) -> Callable[[M], Awaitable[BaseModel]]:
    async def answer(request: M) -> BaseModel:
        return call(request)

    return answer


def router_routes(participant: Participant, token: str) -> list[Route]:
    """The protocol's routes (``/checkpoint/v1/...`` and ``/episodes/run``), to mount on an
    existing Starlette app. Whoever serves them starts the lease watcher
    (:meth:`Participant.start`) or uses :func:`participant_app`, whose lifespan does."""
    if not token:
        raise InvalidInput("a participant server needs a non-empty token")
    p = participant

    async def status(request: Request) -> Response:
        return _reply(p.status())

    posts: dict[str, Handler] = {
        "prepare": _post(wire.PrepareRequest, p.prepare),
        "renew": _post(wire.RenewRequest, p.renew),
        "commit": _post(wire.CommitRequest, p.commit),
        "resume": _post(wire.ResumeRequest, p.resume),
        "retire": _post(wire.RetireRequest, p.retire),
        "forget": _post(wire.ForgetRequest, p.forget),
        "restore": _post(wire.RestoreRequest, p.restore),
        "effects": _post(wire.EffectsRequest, _answered(p.applied_effects)),
        "lease": _post(wire.RunLease, _answered(p.take_lease)),
    }
    routes = [Route(f"{wire.PREFIX}/status", _guarded(token, status), methods=["GET"])]
    routes += [
        Route(f"{wire.PREFIX}/{op}", _guarded(token, handler), methods=["POST"])
        for op, handler in posts.items()
    ]
    run = _post(wire.RunEpisode, p.run)
    routes.append(Route(wire.EPISODES_RUN, _guarded(token, run), methods=["POST"]))
    return routes


def participant_lifespan(
    participant: Participant,
) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """An app's lifespan that runs ``participant``'s lease watcher while the app serves."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        participant.start()
        try:
            yield
        finally:
            await participant.aclose()

    return lifespan


def participant_app(participant: Participant, token: str) -> Starlette:
    """A Starlette app serving ``participant``; its lifespan runs the lease watcher. Each
    request gets a server span, the caller's child, when tracing is configured (an app of
    your own mounting :func:`router_routes` adds :class:`~rollsafe.http.tracing.ServerSpans`
    itself)."""

    return Starlette(
        routes=router_routes(participant, token),
        lifespan=participant_lifespan(participant),
        middleware=[Middleware(ServerSpans), Middleware(ContractHeaders)],
    )
