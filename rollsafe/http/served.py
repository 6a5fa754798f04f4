"""A rollsafe server run as its own process (``rollsafe engine serve``, ``rollsafe env serve``).

Each serve command prints one line once it listens, naming its URL (``--port 0`` lets the OS
pick the port; :func:`listening_url` reads the real one); :func:`start_served` waits for that
line. Processes are ended by their pid,
never by name: :meth:`ServedProcess.stop` terminates (then kills), :meth:`ServedProcess.crash`
kills outright, as a machine failure would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rollsafe.children import env_for_child
from rollsafe.errors import ServerDidNotStart

if TYPE_CHECKING:
    import uvicorn

# How long a served process keeps an idle connection open, and how long its clients keep one:
# the client's must be shorter, so a request never goes out on a connection the server is
# closing (at equal timeouts that race shows as a ReadError from a healthy server).
SERVER_KEEPALIVE_S = 5
CLIENT_KEEPALIVE_S = 2.0

START_TIMEOUT_S = 60.0  # how long a server may take to print that it listens

ENGINE_BANNER = r"rollsafe engine serving {kind} on (http://\S+)"
ENV_BANNER = r"rollsafe env serving {name} {instance} on (http://\S+)"


def server_config(
    app: Any, host: str, port: int, *, lifespan: Literal["on", "off"]
) -> uvicorn.Config:
    """How every rollsafe server runs under uvicorn: no access log, 5 s for requests in flight
    at shutdown, idle connections kept SERVER_KEEPALIVE_S (longer than its clients keep them)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        access_log=False,
        lifespan=lifespan,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=SERVER_KEEPALIVE_S,
    )


def listening_url(server: uvicorn.Server) -> str:
    """The URL a started uvicorn server listens on, with the real port (0 asked for any)."""
    port = server.servers[0].sockets[0].getsockname()[1]
    host = server.config.host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}"


def rollsafe_command(*args: str) -> list[str]:
    """``rollsafe ARGS`` with this interpreter: the same installation as the caller."""
    return [sys.executable, "-m", "rollsafe", *args]


class ServedProcess:
    """One server process; its stdout and stderr go to files under ``logs``."""

    def __init__(
        self,
        command: list[str],
        logs: Path,
        env: Mapping[str, str] | None = None,
        niceness: int = 0,
    ) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.command = command
        self.out, self.err = logs / "stdout", logs / "stderr"
        self.url = ""
        with self.out.open("wb") as stdout, self.err.open("wb") as stderr:
            self.proc = subprocess.Popen(
                command, stdout=stdout, stderr=stderr, env=env_for_child(env)
            )
        if niceness:  # by pid, the child we just started (no preexec_fn: we run threads)
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, niceness)

    def wait_listening(self, banner: str, timeout_s: float = START_TIMEOUT_S) -> ServedProcess:
        """Wait for the line matching ``banner`` (its group 1 is the URL); stop the process
        and raise :class:`ServerDidNotStart` if it exits or the time runs out."""
        pattern = re.compile(banner)
        deadline = time.monotonic() + timeout_s
        while not (match := pattern.search(self.out.read_text())):
            if not self.alive() or time.monotonic() > deadline:
                self.stop()
                tail = self.err.read_text()[-3000:]
                raise ServerDidNotStart(f"{' '.join(self.command[2:5])} did not start:\n{tail}")
            time.sleep(0.05)
        self.url = match.group(1)
        return self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        """Terminate by pid, wait, kill if it will not go."""
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def crash(self) -> None:
        """SIGKILL by pid: the process dies with everything it held in memory."""
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=15)


def start_served(
    args: list[str],
    banner: str,
    logs: Path,
    env: Mapping[str, str] | None = None,
    timeout_s: float = START_TIMEOUT_S,
    niceness: int = 0,
) -> ServedProcess:
    """Start ``rollsafe ARGS`` (at ``niceness``: a lower CPU priority) and wait until it
    listens."""
    server = ServedProcess(rollsafe_command(*args), logs, env, niceness)
    return server.wait_listening(banner, timeout_s)
