"""A participant that accepts a connection and never answers (issue 22, part 5): a hung
environment instance fails ``prepare`` as a transient error naming it, within its deadline,
and the instances that did park are resumed. The hung side is a socket that accepts and never
reads: what a wedged process or a half-dead node looks like from the caller. (A hung engine
during the cut or the resume is not covered yet: docs/operations.md "What happens when".)"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rollsafe.env.client import EnvClient
from rollsafe.env.fleet import EnvFleet
from rollsafe.errors import TransientError
from rollsafe.http.bearer import ENGINE_TOKEN_ENV, ENV_TOKEN_ENV
from rollsafe.http.served import ENV_BANNER, start_served

pytestmark = pytest.mark.timeout(120)

TOKEN = "hung-env-token"
CONTROL_S, GRACE_S = 1.0, 0.5  # each control call's deadline: the test's whole wait


@contextmanager
def black_hole() -> Iterator[str]:
    """A URL whose server accepts every connection and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])  # kept open, never read
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, name="black-hole", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        listener.close()


def test_a_hung_instance_fails_prepare_as_transient_and_the_parked_ones_resume(
    tmp_path: Path,
) -> None:
    args = ["env", "serve", "workplace", "--port", "0", "--instance", "w0"]
    args += ["--engine-url", "http://127.0.0.1:9"]  # no episode runs here: never called
    banner = ENV_BANNER.format(name="workplace", instance="w0")
    tokens = {ENV_TOKEN_ENV: TOKEN, ENGINE_TOKEN_ENV: "unused-engine-token"}
    server = start_served(args, banner, tmp_path / "w0", env=tokens)
    try:
        with black_hole() as hung:

            async def prepare() -> tuple[TransientError, str]:
                clients = {
                    "w0": EnvClient(server.url, TOKEN, timeout_s=CONTROL_S, grace_s=GRACE_S),
                    "w1": EnvClient(hung, TOKEN, timeout_s=CONTROL_S, grace_s=GRACE_S),
                }
                try:
                    fleet = EnvFleet(clients)
                    with pytest.raises(TransientError) as failed:
                        await fleet.prepare_all("hung-1", time.time() + CONTROL_S)
                    return failed.value, (await clients["w0"].status()).phase
                finally:
                    for client in clients.values():
                        await client.aclose()

            error, w0_phase = asyncio.run(prepare())
        said = str(error) + " ".join(getattr(error, "__notes__", []))
        assert "w1" in said, said  # the hung instance is named
        assert w0_phase == "idle"  # parked, then resumed when w1 failed
    finally:
        server.stop()
