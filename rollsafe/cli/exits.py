"""How every ``rollsafe`` command ends: its exit code, and one line on stderr when it fails.

The codes (documented once, in docs/operations.md, "Exit codes"):

- 0: the command did what it was asked;
- 1: a runtime failure: a dependency unreachable, a snapshot that does not verify, a check
  that fails, an error raised while doing the work;
- 2: a usage error only: a bad flag or argument, a malformed file the user gave
  (:class:`~rollsafe.errors.InvalidInput`, or a pydantic ``ValidationError`` of the options).
  click's own usage errors (unknown option, bad choice, port out of range) exit 2 too.
- 3: ``env-check`` only: every check ran and passed, but what decides a lossless restore
  could not be compared (effects, state): "passed, not verified".
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from enum import IntEnum
from typing import NoReturn

import typer
from pydantic import ValidationError

from rollsafe.errors import InvalidInput, TemporalUnavailable
from rollsafe.temporal.diagnose import UNREACHABLE_FIX


class ExitCode(IntEnum):
    OK = 0
    FAILURE = 1
    USAGE = 2
    UNVERIFIED = 3  # env-check: passed, not verified


# Each command's help ends with this, so the table stays in one place.
EXIT_CODES = (
    "Exit codes: 0 success, 1 runtime failure, 2 usage error (docs/operations.md, 'Exit codes')."
)

# What to do about an error the command cannot fix itself, appended to its line. Temporal's
# address comes from the environment, never a flag: the fix names the variables. A connection
# that failed on TLS carries its own fix (rollsafe.temporal.diagnose); this is for the others.
TEMPORAL_FIX = UNREACHABLE_FIX
RAY_FIX = "start Ray (`ray start --head`) or pass --ray-address / RAY_ADDRESS"


def exit_code_for(error: BaseException) -> ExitCode:
    """2 for the user's own bad input, 1 for anything that went wrong while doing the work."""
    if isinstance(error, InvalidInput | ValidationError):
        return ExitCode.USAGE
    return ExitCode.FAILURE


def _describe(error: BaseException) -> str:
    """The error as one line: pydantic's own text spans several, with a link per error."""
    if isinstance(error, ValidationError):
        return "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" if e["loc"] else e["msg"]
            for e in error.errors()
        )
    return str(error)


def _fix_for(error: BaseException) -> str | None:
    if isinstance(error, TemporalUnavailable):
        return error.fix or TEMPORAL_FIX
    return None


def fail(error: BaseException | str, code: ExitCode | None = None) -> NoReturn:
    """Print ``error: <what failed>`` (and the fix, when one is known) as one line on stderr
    and exit with ``code`` (default: :func:`exit_code_for` the error; 1 for a plain message).
    No traceback: what the user needs is what failed and what to do."""
    fix = None if isinstance(error, str) else _fix_for(error)
    what = error if isinstance(error, str) else _describe(error)
    line = f"error: {what}" + (f" (fix: {fix})" if fix else "")
    typer.echo(line, err=True)
    if code is None:
        code = ExitCode.FAILURE if isinstance(error, str) else exit_code_for(error)
    raise typer.Exit(int(code)) from None


def usage_error(message: str) -> NoReturn:
    """A bad flag or argument this command found itself (click finds the others)."""
    fail(InvalidInput(message))


# Set by a command that made a Temporal client (it lives until the process ends).
_temporal_client_made = False


def temporal_client_made() -> None:
    """This process made (or tried to make) a Temporal client: :func:`run_command` then ends
    it without the interpreter's teardown. The client's Rust threads can call into a finalizing
    interpreter, which aborts it (exit 134, ``Fatal Python error: PyGILState_Release``:
    temporalio sdk-python#300), after the command has done its work and printed its result."""
    global _temporal_client_made
    _temporal_client_made = True


# Set (to anything) to see the traceback of an error no command anticipated.
TRACEBACK_ENV = "ROLLSAFE_TRACEBACK"


def run_command(main: Callable[[], object]) -> NoReturn:
    """Run the ``rollsafe`` command (``main``: the typer app, which exits with its code) and
    exit with that code; skips the teardown after a Temporal client (see above). An error no
    command anticipated is a bug, and still one line (exit 1), never a traceback: whatever a
    command reads, its user sees what failed (``ROLLSAFE_TRACEBACK=1`` shows where)."""
    try:
        main()
        code: object = 0
    except SystemExit as exit_:
        code = exit_.code
    except Exception as exc:  # the last resort: every anticipated error has its own line
        if os.environ.get(TRACEBACK_ENV):
            raise
        what = f"{type(exc).__name__}: {exc}".splitlines()[0]
        print(
            f"error: internal error: {what} (a bug in rollsafe: please report it; "
            f"{TRACEBACK_ENV}=1 shows the traceback)",
            file=sys.stderr,
        )
        code = int(ExitCode.FAILURE)
    status = code if isinstance(code, int) else (0 if code is None else 1)
    if not _temporal_client_made:
        sys.exit(status)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
