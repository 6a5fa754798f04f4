"""The gateway over HTTP: the OpenAI API, the checkpoint protocol, the tool proxies.

Main app (one port)::

    GET  /v1/models                              (also under /sessions/{session})
    POST /v1/chat/completions                    (also under /sessions/{session})
    POST /v1/responses                           (also under /sessions/{session})
    POST /sessions/{session}/tools/{server}/...  a tool server through the proxy
    /checkpoint/v1/..., POST /episodes/run        the checkpoint protocol (env token)

A model call's session: the path (``/sessions/{session}/v1/...``), else the
``X-Rollsafe-Session`` header, else ``metadata.rollsafe_session``, else the
``rollsafe_session`` cookie; a tool call's the same, else the episode its JSON body names
(``episode_id``, as a NeMo Gym 0.7 environment server seeds a resources session). Each tool
proxy also listens at the root of a port of its own (:func:`tool_app`), where NeMo Gym's agents
expect a resources server. The OpenAI routes are served under NeMo Gym's rollout prefixes too
(``/ng-rollout/{id}/v1/...``, ``/ng-rollout/{id}/training-token-capture/v1/...``: an agent
carries its episode's prefix to its model calls, and model servers strip it).

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 a malformed
request (the message names the field), 401 the API token, 409 a refused session
(``session_ended``, ``checkpoint_parked``) or a replay that diverged (``ReplayDiverged``), 503
the engine or a tool server unavailable.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollsafe.env.participant import Participant
from rollsafe.env.router import field_problems, participant_lifespan, router_routes
from rollsafe.errors import (
    InvalidInput,
    InvariantError,
    ParticipantRefused,
    ReplayDiverged,
    TransientError,
)
from rollsafe.gateway.convert import chat_prompt, chat_reply, responses_prompt, responses_reply
from rollsafe.gateway.hooks import GatewayHooks
from rollsafe.gateway.sessions import check_session_id
from rollsafe.gateway.streaming import CallStream, chat_sse, responses_sse
from rollsafe.gateway.tools import SESSION_COOKIE, SESSION_HEADER
from rollsafe.gateway.wire import (
    SESSION_METADATA_KEY,
    ChatRequest,
    ModelCard,
    ModelList,
    ResponsesRequest,
)
from rollsafe.http.bearer import token_matches
from rollsafe.http.contract import ContractHeaders
from rollsafe.http.tracing import ServerSpans

M = TypeVar("M", bound=BaseModel)
# NeMo Gym 0.7's rollout correlation: an agent sends its model calls under its episode's prefix
# (nemo_gym.rollout_correlation), which a model server strips; the session is found as always.
NEMO_GYM_ROLLOUT_PREFIXES = (
    "/ng-rollout/{rollout_key}",
    "/ng-rollout/{rollout_key}/training-token-capture",
)
log = logging.getLogger(__name__)
Handler = Callable[[Request], Awaitable[Response]]
STARTED = int(time.time())


def _openai_error(status: int, message: str, kind: str, param: str | None = None) -> Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": kind}}
    return JSONResponse(body, status_code=status)


def error_response(exc: Exception) -> Response:
    if isinstance(exc, ParticipantRefused):
        return _openai_error(409, str(exc), exc.reason)
    if isinstance(exc, ReplayDiverged):
        return _openai_error(409, str(exc), "ReplayDiverged")
    if isinstance(exc, InvalidInput):
        return _openai_error(400, str(exc), "invalid_request_error")
    if isinstance(exc, InvariantError):
        return _openai_error(409, str(exc), type(exc).__name__)
    if isinstance(exc, TransientError):
        return _openai_error(503, str(exc), type(exc).__name__)
    log.exception("gateway request failed", exc_info=exc)
    return _openai_error(500, f"{type(exc).__name__}: {exc}", "internal_error")


async def _parse(request: Request, model: type[M]) -> M:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise InvalidInput(f"{model.__name__}: {field_problems(exc)}") from None


def session_of(request: Request, metadata: Mapping[str, str] | None = None) -> str:
    """The call's session (see the module docstring); InvalidInput naming the ways."""
    found = (
        request.path_params.get("session")
        or request.headers.get(SESSION_HEADER)
        or (metadata or {}).get(SESSION_METADATA_KEY)
        or request.cookies.get(SESSION_COOKIE)
    )
    if not found:
        raise InvalidInput(
            "no session: use the base URL /sessions/<session>/v1, the X-Rollsafe-Session "
            f"header, metadata.{SESSION_METADATA_KEY}, or the {SESSION_COOKIE} cookie"
        )
    return check_session_id(str(found))


def _tool_session(request: Request, hooks: GatewayHooks, body: bytes) -> str:
    """A tool call's session (see the module docstring); failing those, the session of the
    episode its JSON body names (``episode_id``: a NeMo Gym 0.7 environment server seeding,
    verifying or closing the resources session itself, with no cookie of ours yet)."""
    try:
        return session_of(request)
    except InvalidInput:
        episode = _episode_named(body)
        found = None if episode is None else hooks.session_of_episode(*episode)
        if found is None:
            raise
        return found


def _episode_named(body: bytes) -> tuple[str, int] | None:
    try:
        named = json.loads(body).get("episode_id") if body else None
    except (ValueError, AttributeError):
        return None
    if not isinstance(named, dict):
        return None
    rollout, attempt = named.get("rollout_id"), named.get("attempt", 0)
    if not isinstance(rollout, str) or not isinstance(attempt, int):
        return None
    return rollout, attempt


def _with_cookie(response: Response, session: str) -> Response:
    # Agents that carry cookies from reply to call (NeMo Gym's) carry the session with them.
    response.set_cookie(SESSION_COOKIE, session, httponly=True, samesite="strict")
    return response


def _guard(api_token: str | None, handler: Handler) -> Handler:
    async def endpoint(request: Request) -> Response:
        if api_token is not None and not token_matches(
            request.headers.get("authorization", "").encode(), api_token
        ):
            return _openai_error(401, "missing or wrong bearer token", "invalid_api_key")
        try:
            return await handler(request)
        except Exception as exc:
            return error_response(exc)

    return endpoint


def openai_routes(hooks: GatewayHooks, api_token: str | None) -> list[Route]:
    model = hooks.served.model

    async def models(request: Request) -> Response:
        listed = ModelList(data=[ModelCard(id=model, created=STARTED)])
        return Response(listed.model_dump_json(), media_type="application/json")

    async def chat(request: Request) -> Response:
        body = await _parse(request, ChatRequest)
        session = session_of(request, body.metadata)
        prompt = chat_prompt(body)
        if not body.stream:
            answer = await hooks.session(session).model_call(prompt)
            return _with_cookie(JSONResponse(chat_reply(answer, logprobs=body.logprobs)), session)
        call = CallStream(hooks.session(session), prompt)
        await call.opened()
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = chat_sse(call, logprobs=body.logprobs, include_usage=include_usage)
        return _with_cookie(_event_stream(events), session)

    async def responses(request: Request) -> Response:
        body = await _parse(request, ResponsesRequest)
        session = session_of(request, body.metadata)
        prompt = responses_prompt(body)
        if not body.stream:
            answer = await hooks.session(session).model_call(prompt)
            return _with_cookie(JSONResponse(responses_reply(answer, body)), session)
        call = CallStream(hooks.session(session), prompt)
        await call.opened()
        return _with_cookie(_event_stream(responses_sse(call, body)), session)

    routes = []
    for prefix in ("", "/sessions/{session}", *NEMO_GYM_ROLLOUT_PREFIXES):
        routes += [
            Route(f"{prefix}/v1/models", _guard(api_token, models), methods=["GET"]),
            Route(f"{prefix}/v1/chat/completions", _guard(api_token, chat), methods=["POST"]),
            Route(f"{prefix}/v1/responses", _guard(api_token, responses), methods=["POST"]),
        ]
    return routes


def _event_stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    # No buffering between here and the client (a proxy that honours it sends each event on).
    headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def proxy_handler(hooks: GatewayHooks, server_name: str | None) -> Handler:
    """A tool call through the proxy: ``server_name`` fixed (a proxy port of its own) or from
    the path (``/sessions/{session}/tools/{server}/...``)."""

    async def handler(request: Request) -> Response:
        name = server_name or request.path_params["server"]
        server = hooks.tools.get(name)
        if server is None:
            raise InvalidInput(f"no tool server {name!r} (known: {', '.join(sorted(hooks.tools))})")
        body = await request.body()
        session = _tool_session(request, hooks, body)
        path = "/" + request.path_params.get("path", "")
        if request.url.query:
            path += f"?{request.url.query}"
        made = await hooks.session(session).tool_call(
            server, request.method, path, body, request.headers.get("content-type", "")
        )
        reply = Response(made.reply, status_code=made.status, media_type=made.content_type or None)
        return _with_cookie(reply, session)

    return handler


def gateway_app(
    hooks: GatewayHooks, participant: Participant, env_token: str, api_token: str | None
) -> Starlette:
    """The main app; its lifespan runs the participant's lease watcher."""
    tools = _guard(api_token, proxy_handler(hooks, None))
    routes = [
        *openai_routes(hooks, api_token),
        Route("/sessions/{session}/tools/{server}/{path:path}", tools, methods=["GET", "POST"]),
        *router_routes(participant, env_token),
    ]
    return Starlette(
        routes=routes,
        lifespan=participant_lifespan(participant),
        # OpenAI clients send no contract: served as they are (rollsafe.http.contract).
        middleware=[Middleware(ServerSpans), Middleware(ContractHeaders, strangers=True)],
    )


def tool_app(hooks: GatewayHooks, server: str, api_token: str | None) -> Starlette:
    """One tool proxy at the root of its own port."""
    handler = _guard(api_token, proxy_handler(hooks, server))
    return Starlette(routes=[Route("/{path:path}", handler, methods=["GET", "POST"])])
