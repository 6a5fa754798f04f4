"""Bearer tokens for the commands that serve or call an HTTP server: from an environment
variable, or from a file named on the command line (``--token-file``, ``--engine-token-file``,
``--api-token-file``), which beats the variable.

Never the token itself on the command line: ``ps`` shows a command line to every user of the
machine. ``--token``, ``--engine-token`` and ``--api-token`` are hidden options that only
refuse (exit 2, one line naming the variable and the file flag, never the value given).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from rollsafe.cli.exits import usage_error
from rollsafe.errors import InvalidInput
from rollsafe.http.bearer import ENGINE_TOKEN_ENV, ENV_TOKEN_ENV, read_token_file


def refused_token_option(flag: str, envvar: str) -> Any:
    """A hidden ``flag`` (e.g. ``--token``) that takes a value only to refuse it: the token
    comes from ``envvar`` or ``flag-file``. The value is never echoed."""

    def refuse(value: str | None) -> None:
        if value is not None:
            usage_error(
                f"{flag} is not accepted: a command line is visible to every user of the "
                f"machine (ps); set {envvar} or give {flag}-file"
            )

    return typer.Option(flag, hidden=True, callback=refuse, expose_value=False)


def token_file_option(flag: str = "--token-file", envvar: str | None = None) -> Any:
    """``--token-file``-style: a file holding the token (``envvar`` is the alternative)."""
    alternative = f"; or set {envvar}" if envvar else ""
    return typer.Option(
        flag,
        dir_okay=False,
        help=f"read the token from this file (surrounding whitespace stripped){alternative}",
    )


# The pairs (the refused flag, the file) of the engine token every command that calls an
# engine takes, and of an environment instance's token (``env serve``, ``env-check``, the
# gateway). The refused flag's parameter is always None: declared so that click consumes the
# value, never passed to the command.
EngineToken = Annotated[str | None, refused_token_option("--engine-token", ENGINE_TOKEN_ENV)]
EngineTokenFile = Annotated[Path | None, token_file_option("--engine-token-file", ENGINE_TOKEN_ENV)]
EnvToken = Annotated[str | None, refused_token_option("--token", ENV_TOKEN_ENV)]
EnvTokenFile = Annotated[Path | None, token_file_option("--token-file", ENV_TOKEN_ENV)]


def resolve_token(file: Path | None, *, file_flag: str, envvar: str) -> str | None:
    """The token: the file's when ``file`` (``file_flag``) is given (a file named on the
    command line beats a variable set in the shell), else variable ``envvar``'s; None when
    neither is given. InvalidInput when the file cannot be read or the token is empty."""
    if file is not None:
        return read_token_file(file, file_flag)
    value = os.environ.get(envvar)
    if value is None:
        return None
    if not value.strip():
        raise InvalidInput(f"{envvar} must not be empty: set it to the token, or give {file_flag}")
    return value


def required_token(file: Path | None, *, file_flag: str, envvar: str) -> str:
    """:func:`resolve_token`, and InvalidInput naming both ways when neither was given."""
    token = resolve_token(file, file_flag=file_flag, envvar=envvar)
    if token is None:
        raise InvalidInput(f"no token: set {envvar}, or give {file_flag}")
    return token
