"""The engine protocol over HTTP: how environment servers reach a policy model.

:func:`engine_app` serves any :class:`~rollsafe.engine.protocol.Engine` as an ASGI app;
:class:`EngineClient` speaks the same protocol to it, so code written against ``Engine`` runs
against a remote engine unchanged. Streams are NDJSON, one event per line. Errors travel as
``{"error": <class name>, "detail": <message>}`` and come back as the same rollsafe error.

A stream's first event is awaited before the response starts, so admission errors (duplicate
call id, bad prompt, :class:`~rollsafe.errors.PrefixMismatch`) arrive as a status code. While a
call is quiet (frozen by a cut) the server sends a blank line every ``heartbeat_s`` seconds, so
the client can keep a per-read timeout that catches a dead server without cutting off a
frozen call.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Annotated, Any, Literal, Protocol, TypeVar

import httpx
import torch
import uvicorn
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollsafe import errors
from rollsafe.engine.protocol import (
    CUT_BATCH,
    CutReport,
    Engine,
    EngineInfo,
    FinishEvent,
    GenerateRequest,
    PrefixRecord,
    StreamEvent,
    TokenEvent,
)
from rollsafe.engine.weights import WeightUpdatable, decode_weights, encode_weights
from rollsafe.errors import (
    EngineUnavailable,
    InvalidInput,
    PrefixMismatch,
    RollsafeError,
    TransientError,
)
from rollsafe.faults import fault_point, register
from rollsafe.http import bearer
from rollsafe.http.bearer import Handler
from rollsafe.http.client import http_client
from rollsafe.http.contract import ContractHeaders
from rollsafe.http.served import listening_url, server_config
from rollsafe.http.tracing import ServerSpans
from rollsafe.observability.tracing import configure_tracing

M = TypeVar("M", bound=BaseModel)
# An engine server's cut, received and not yet answered (issue 22: an engine dying mid-cut).
CUT_RECEIVED = register("engine.cut.received")[0]
log = logging.getLogger(__name__)
NDJSON = "application/x-ndjson"
HEARTBEAT_S = 10.0
_JSON = {"content-type": "application/json"}
# Any other error (an invariant broken, a bug) is a 500.
_STATUS = ((PrefixMismatch, 409), (InvalidInput, 422), (TransientError, 503))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ResumeBody(_Model):
    request: GenerateRequest
    prefix: PrefixRecord


class CutBody(_Model):
    call_ids: tuple[str, ...]
    batch_size: int = Field(default=CUT_BATCH, ge=1)


class ReleaseBody(_Model):
    call_ids: tuple[str, ...]


class _ErrorLine(_Model):
    kind: Literal["error"]
    error: str
    detail: str
    call_id: str = ""  # PrefixMismatch's fields
    field: str = ""


_Line = TypeAdapter[TokenEvent | FinishEvent | _ErrorLine](
    Annotated[TokenEvent | FinishEvent | _ErrorLine, Field(discriminator="kind")]
)


class ClosableEngine(Engine, Protocol):
    async def close(self) -> None: ...  # what `serve` needs besides the protocol


# -- server ---------------------------------------------------------------------------------


def _error_fields(exc: Exception) -> dict[str, str]:
    fields = {"error": type(exc).__name__, "detail": str(exc)}
    if isinstance(exc, PrefixMismatch):  # the client rebuilds it with what it names
        fields.update(call_id=exc.call_id, field=exc.field)
    return fields


def _error_response(exc: Exception) -> Response:
    status = next((code for cls, code in _STATUS if isinstance(exc, cls)), 500)
    return JSONResponse(_error_fields(exc), status_code=status)


async def _parse(request: Request, model: type[M]) -> M:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise InvalidInput(str(exc)) from None


async def _stream(events: AsyncIterator[StreamEvent], heartbeat_s: float) -> Response:
    try:
        first = await anext(events)
    except StopAsyncIteration:
        return _error_response(EngineUnavailable("the engine ended the stream before any event"))
    except Exception as exc:
        return _error_response(exc)
    return StreamingResponse(_lines(first, events, heartbeat_s), media_type=NDJSON)


async def _lines(
    first: StreamEvent, events: AsyncIterator[StreamEvent], heartbeat_s: float
) -> AsyncIterator[bytes]:
    yield first.model_dump_json().encode() + b"\n"
    # The next event is a task that a heartbeat does not cancel: cancelling it would throw
    # into the engine's stream and end the call.
    pending: asyncio.Future[StreamEvent] | None = None
    try:
        while True:
            pending = asyncio.ensure_future(anext(events))
            while not (await asyncio.wait({pending}, timeout=heartbeat_s))[0]:
                yield b"\n"
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            yield event.model_dump_json().encode() + b"\n"
    except Exception as exc:
        line = _ErrorLine(kind="error", **_error_fields(exc))
        yield line.model_dump_json(exclude_defaults=True).encode() + b"\n"
    finally:
        # The client went away (or the server is stopping): end the call on the engine. A
        # running next-event task holds the stream, so it is cancelled rather than closed.
        if pending is not None and not pending.done():
            pending.cancel()
        else:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()


def engine_app(engine: Engine, token: str, *, heartbeat_s: float = HEARTBEAT_S) -> Starlette:  # noqa: C901 (its routes are nested: counted in)
    """``engine`` over HTTP; every endpoint but ``/v1/health`` wants ``Bearer <token>``."""
    if not token:
        raise InvalidInput("an engine server needs a non-empty token")

    def guarded(handler: Handler) -> Handler:
        return bearer.guarded(token, handler, _error_response)

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def info(request: Request) -> Response:
        return _json(await engine.info())

    async def generate(request: Request) -> Response:
        body = await _parse(request, GenerateRequest)
        return await _stream(engine.generate(body), heartbeat_s)

    async def resume(request: Request) -> Response:
        body = await _parse(request, ResumeBody)
        return await _stream(engine.resume(body.request, body.prefix), heartbeat_s)

    async def cut(request: Request) -> Response:
        body = await _parse(request, CutBody)
        fault_point(CUT_RECEIVED)  # a drill's engine dies here: a cut in flight, no answer
        return _json(await engine.cut(body.call_ids, batch_size=body.batch_size))

    async def release(request: Request) -> Response:
        body = await _parse(request, ReleaseBody)
        return JSONResponse({"released": await engine.release(body.call_ids)})

    async def weights(request: Request) -> Response:
        if not isinstance(engine, WeightUpdatable):
            raise InvalidInput(f"{type(engine).__name__} does not take weight updates")
        try:
            version = int(request.query_params["version"])
        except (KeyError, ValueError):
            raise InvalidInput("POST /v1/weights?version=<int>: version missing") from None
        await engine.update_weights(decode_weights(await request.body()), version)
        return JSONResponse({"weight_version": version})

    return Starlette(
        routes=[
            Route("/v1/health", health, methods=["GET"]),
            Route("/v1/info", guarded(info), methods=["GET"]),
            Route("/v1/generate", guarded(generate), methods=["POST"]),
            Route("/v1/resume", guarded(resume), methods=["POST"]),
            Route("/v1/cut", guarded(cut), methods=["POST"]),
            Route("/v1/release", guarded(release), methods=["POST"]),
            Route("/v1/weights", guarded(weights), methods=["POST"]),
        ],
        # A span per request, the caller's child (when tracing is configured).
        middleware=[Middleware(ServerSpans), Middleware(ContractHeaders)],
    )


def _json(model: BaseModel) -> Response:
    # pydantic's JSON, not json.dumps: floats round-trip bit for bit either way, this is faster.
    return Response(model.model_dump_json(), media_type="application/json")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: ClosableEngine) -> None:
        super().__init__(config)
        self.engine = engine

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            kind = (await self.engine.info()).kind
            url = listening_url(self)
            print(f"rollsafe engine serving {kind} on {url}", flush=True)
            log.info("engine %s serving on %s", kind, url)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        log.info("engine stopping: in-flight calls end with EngineUnavailable")
        # Engine first: in-flight streams end with an error line (EngineUnavailable at the
        # client) instead of holding the graceful shutdown open, frozen calls forever.
        await self.engine.close()
        await super().shutdown(sockets)
        log.info("engine stopped")


async def serve(engine: ClosableEngine, host: str, port: int, token: str) -> None:
    """Serve ``engine`` until SIGINT/SIGTERM, then close it. Prints one line once listening.
    Spans per request go where ``OTEL_TRACES_EXPORTER`` says."""
    configure_tracing()
    app = engine_app(engine, token)
    config = server_config(app, host, port, lifespan="off")
    try:
        await _Server(config, engine).serve()
    finally:
        await engine.close()  # also when startup failed (port taken); closing twice is a no-op


# -- client ---------------------------------------------------------------------------------


class EngineClient:
    """The engine protocol against an :func:`engine_app` server, raising rollsafe errors.

    ``timeout`` bounds each read (and write), never a whole stream: a long generation is a
    stream of short reads, and a frozen call gets heartbeats.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 60.0,
        connect_timeout: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http_client(
            self.base_url,
            token,
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            transport=transport,
        )

    def generate(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        return self._stream("/v1/generate", request.model_dump_json())

    def resume(self, request: GenerateRequest, prefix: PrefixRecord) -> AsyncIterator[StreamEvent]:
        return self._stream(
            "/v1/resume", ResumeBody(request=request, prefix=prefix).model_dump_json()
        )

    async def cut(self, call_ids: Sequence[str], *, batch_size: int = CUT_BATCH) -> CutReport:
        body = CutBody(call_ids=tuple(call_ids), batch_size=batch_size)
        return CutReport.model_validate_json(await self._call("POST", "/v1/cut", body))

    async def release(self, call_ids: Sequence[str]) -> int:
        body = ReleaseBody(call_ids=tuple(call_ids))
        released = json.loads(await self._call("POST", "/v1/release", body))["released"]
        return int(released)

    async def info(self) -> EngineInfo:
        return EngineInfo.model_validate_json(await self._call("GET", "/v1/info", None))

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load ``weights`` as ``version`` (newer than the engine's) between two tokens."""
        try:
            response = await self._http.post(
                "/v1/weights", params={"version": version}, content=encode_weights(weights)
            )
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc
        if response.status_code != 200:
            raise self._error(response.status_code, response.content)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(self, method: str, path: str, body: BaseModel | None) -> bytes:
        content = body.model_dump_json() if body is not None else None
        try:
            response = await self._http.request(method, path, content=content, headers=_JSON)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc
        if response.status_code != 200:
            raise self._error(response.status_code, response.content)
        return response.content

    async def _stream(self, path: str, content: str) -> AsyncIterator[StreamEvent]:
        finished = False
        try:
            async with self._http.stream("POST", path, content=content, headers=_JSON) as response:
                if response.status_code != 200:
                    raise self._error(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    if not line.strip():  # heartbeat
                        continue
                    event = _Line.validate_json(line)
                    if isinstance(event, _ErrorLine):
                        raise self._rebuild(event.error, event.detail, event.model_dump(), 500)
                    yield event
                    if isinstance(event, FinishEvent):
                        finished = True
                        return
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc
        if not finished:
            raise EngineUnavailable(f"engine at {self.base_url}: {path} ended before a finish")

    def _unavailable(self, exc: httpx.TransportError) -> EngineUnavailable:
        return EngineUnavailable(f"engine at {self.base_url} unreachable: {exc!r}")

    def _error(self, status: int, content: bytes) -> RollsafeError:
        try:
            fields = json.loads(content)
            name, detail = str(fields["error"]), str(fields["detail"])
        except (ValueError, TypeError, KeyError):  # not ours: a proxy's page, say
            fields, name, detail = {}, f"HTTP {status}", content[:200].decode(errors="replace")
        return self._rebuild(name, detail, fields, status)

    def _rebuild(self, name: str, detail: str, fields: Any, status: int) -> RollsafeError:
        if status == 401:
            return InvalidInput(f"engine at {self.base_url} refused the token: {detail}")
        cls = getattr(errors, name, None)
        if isinstance(cls, type) and issubclass(cls, RollsafeError):
            # The class and message the server raised; PrefixMismatch keeps what it names.
            error = errors._rebuild(cls, detail)
            if isinstance(error, PrefixMismatch):
                error.call_id = str(fields.get("call_id", ""))
                error.field = str(fields.get("field", ""))
            return error
        message = f"engine at {self.base_url} failed ({status} {name}): {detail}"
        return EngineUnavailable(message) if status >= 500 else InvalidInput(message)
