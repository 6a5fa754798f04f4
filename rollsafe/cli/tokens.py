"""Bearer tokens for the commands that serve or call an HTTP server: from an environment
variable or a file (``--token-file``), so no token need ever appear on a command line, where
``ps`` shows it to every user of the machine. ``--token`` itself stays for scripts and tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from rollsafe.errors import InvalidInput
from rollsafe.http.bearer import ENGINE_TOKEN_ENV, read_token_file

_VISIBLE = "a command line is visible to other users: prefer the variable or a file"


def token_option(envvar: str, what: str, flag: str = "--token") -> Any:
    """The ``--token``-style option: ``what`` it is, read from ``envvar`` too."""
    return typer.Option(flag, envvar=envvar, help=f"{what} ({_VISIBLE})")


def token_file_option(flag: str = "--token-file") -> Any:
    """``--token-file``-style: a file holding the token."""
    return typer.Option(
        flag,
        dir_okay=False,
        help="read the token from this file (surrounding whitespace stripped)",
    )


# The engine-token pair every command that calls an engine takes, and the plain --token-file.
EngineToken = Annotated[
    str | None, token_option(ENGINE_TOKEN_ENV, "the engine's bearer token", "--engine-token")
]
EngineTokenFile = Annotated[Path | None, token_file_option("--engine-token-file")]
TokenFile = Annotated[Path | None, token_file_option()]


def _from_command_line(ctx: typer.Context, param: str) -> bool:
    """Whether option ``param`` was typed on the command line (not taken from its variable).
    Compared by name: typer's own click (vendored) does not export the enum."""
    source = ctx.get_parameter_source(param)
    return source is not None and source.name == "COMMANDLINE"


def resolve_token(
    ctx: typer.Context, param: str, value: str | None, file: Path | None, *, flag: str, envvar: str
) -> str | None:
    """The token option ``param`` (``flag``, also ``envvar``) and its ``flag-file`` ask for:
    the file's when given (a file named on the command line beats a variable set in the
    shell), else the flag's or the variable's; None when none is given. InvalidInput when
    the flag and the file are both on the command line, or the token is empty."""
    if file is not None:
        if value is not None and _from_command_line(ctx, param):
            raise InvalidInput(f"give {flag} or {flag}-file, not both")
        return read_token_file(file, f"{flag}-file")
    if value is not None and not value.strip():
        raise InvalidInput(f"{flag} (or {envvar}) must not be empty")
    return value


def required_token(
    ctx: typer.Context, param: str, value: str | None, file: Path | None, *, flag: str, envvar: str
) -> str:
    """:func:`resolve_token`, and InvalidInput naming all three ways when none was given."""
    token = resolve_token(ctx, param, value, file, flag=flag, envvar=envvar)
    if token is None:
        raise InvalidInput(f"no token: set {envvar}, or give {flag}-file (or {flag})")
    return token
