"""Bearer tokens on rollsafe's HTTP servers (engine, environment participants): one check, one
401 reply, one wrapper that also turns an endpoint's error into its reply."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rollsafe.errors import InvalidInput

Handler = Callable[[Request], Awaitable[Response]]

# The variables the engine and environment servers (and their clients) read their tokens from.
ENGINE_TOKEN_ENV = "ROLLSAFE_ENGINE_TOKEN"
ENV_TOKEN_ENV = "ROLLSAFE_ENV_TOKEN"


def read_token_file(path: Path, what: str) -> str:
    """The token in the file at ``path``, surrounding whitespace stripped; InvalidInput naming
    ``what`` (e.g. ``--token-file``) when it cannot be read or is empty."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise InvalidInput(f"{what} {path}: cannot read it: {why}") from None
    token = text.strip()
    if not token:
        raise InvalidInput(f"{what} {path} is empty")
    return token


def token_matches(authorization: bytes, token: str) -> bool:
    """``authorization`` (the header's bytes) is ``Bearer <token>``; constant time."""
    return hmac.compare_digest(authorization, f"Bearer {token}".encode())


def unauthorized() -> JSONResponse:
    """The 401 reply; a refused request changes nothing."""
    detail = "missing or wrong bearer token"
    return JSONResponse({"error": "Unauthorized", "detail": detail}, status_code=401)


def guarded(token: str, handler: Handler, on_error: Callable[[Exception], Response]) -> Handler:
    """``handler`` behind the token; an exception it raises becomes ``on_error``'s reply."""

    async def endpoint(request: Request) -> Response:
        if not token_matches(request.headers.get("authorization", "").encode(), token):
            return unauthorized()
        try:
            return await handler(request)
        except Exception as exc:
            return on_error(exc)

    return endpoint
