"""``rollsafe server``: a local Temporal dev server for rollsafe, in the foreground.

Register with ``app.command("server")(server_command)``; the function also runs when called
directly (every parameter has a plain default).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Annotated, Final

import typer

from rollsafe.cli.exits import exit_code_for, fail
from rollsafe.cli.options import LogFormatOption, LogLevelOption, start_logging
from rollsafe.errors import RollsafeError
from rollsafe.temporal.devserver import DevServer

DEFAULT_STATE_DIR: Final = Path("~/.rollsafe/temporal")
_WATCH_S = 0.5


def server_command(
    state_dir: Annotated[
        Path,
        typer.Option(help="holds temporal.db (workflow state, kept across restarts) and the log"),
    ] = DEFAULT_STATE_DIR,
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="gRPC port; 0 picks a free one")
    ] = 7233,
    ip: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    namespace: Annotated[str, typer.Option(help="namespace to create")] = "default",
    log_level: LogLevelOption = None,
    log_format: LogFormatOption = None,
) -> None:
    """Run a Temporal dev server with rollsafe's search attributes until Ctrl-C or SIGTERM.

    Exit 0 once stopped by a signal. Fails (1) when the server fails to start or dies; a state
    dir in use is a usage error (2)."""
    server = DevServer(state_dir, port=port, ip=ip, namespace=namespace)
    try:
        start_logging(log_level, log_format)
        code = asyncio.run(_serve(server))
    except RollsafeError as exc:
        # The message alone: the fix fail() gives for TemporalUnavailable is this command.
        fail(str(exc), exit_code_for(exc))
    if code:
        raise typer.Exit(code)


async def _serve(server: DevServer) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Installed before the server starts: a signal during start-up still stops it in order
    # rather than killing us and orphaning it (it runs in its own session).
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        async with server:
            _announce(server)
            while not stop.is_set():
                if not server.running:
                    typer.echo(f"error: the server died; see {server.log_path}", err=True)
                    return 1
                # Wake on the signal at once, or every _WATCH_S to check the server.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), _WATCH_S)
            typer.echo("stopping the Temporal dev server")
        typer.echo("stopped")
        return 0
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def _announce(server: DevServer) -> None:
    typer.echo(f"Temporal dev server running (pid {server.pid})")
    typer.echo(f"  address:   {server.address}")
    typer.echo(f"  namespace: {server.namespace}")
    typer.echo(f"  state:     {server.db_path} (log: {server.log_path})")
    typer.echo("Point workers and the temporal CLI at it with:")
    typer.echo(f"  export TEMPORAL_ADDRESS={server.address} TEMPORAL_NAMESPACE={server.namespace}")
    typer.echo("Ctrl-C stops it.")
