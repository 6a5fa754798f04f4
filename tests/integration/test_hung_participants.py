"""A participant that accepts a connection and never answers (issue 22, part 5): a hung
environment instance fails ``prepare`` as a transient error naming it, within its deadline,
and the instances that did park are resumed; a hung engine holds neither the cut nor the
resume past ``engine_deadline_s``: its calls are committed at turn level and its release is
given up, both named. The hung side is a socket that accepts and never reads: what a wedged
process or a half-dead node looks like from the caller."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rollsafe.checkpoint.participants import ParticipantOptions, Participants
from rollsafe.checkpoint.phases.cut_generation import cut_calls
from rollsafe.checkpoint.phases.resume import resume_participants
from rollsafe.dataplane import make_dataplane
from rollsafe.engine.http import EngineClient
from rollsafe.env.client import EnvClient
from rollsafe.env.fleet import EnvFleet
from rollsafe.env.fleet_rules import FleetPrepared, InstanceInventory
from rollsafe.env.protocol import EpisodeRef, ParkedEpisode
from rollsafe.errors import TransientError
from rollsafe.http.bearer import ENGINE_TOKEN_ENV, ENV_TOKEN_ENV
from rollsafe.http.served import ENV_BANNER, start_served
from rollsafe.loop_thread import LoopThread

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


class OneInstance:
    """The fleet half a cut and a resume use: one instance, resumed on request."""

    names = ("w0",)

    async def resume_all(self, checkpoint_id: str) -> None:
        return None


def test_a_hung_engine_bounds_the_cut_and_the_resume_by_its_deadline() -> None:
    parked = ParkedEpisode(
        episode=EpisodeRef(rollout_id="run-0_g0", attempt=0),
        turn=1,
        activity="generating",
        model_call_id="run-0_g0/t1",
    )
    inventory = InstanceInventory(parked=(parked,), restarts=(), lease_expires_ts=time.time() + 60)
    prepared = FleetPrepared(
        checkpoint_id="c1", deadline_ts=time.time() + 60, instances={"w0": inventory}
    )
    loop = LoopThread("hung-engine")
    try:
        with black_hole() as hung:
            engine = loop.run(_client(hung))
            options = ParticipantOptions(engine_deadline_s=CONTROL_S)
            participants = Participants(
                OneInstance(),  # type: ignore[arg-type]
                {"e-hung": engine},
                loop=loop,
                options=options,
            )
            cut = cut_calls(participants, prepared, make_dataplane("memory"))
            resumed = resume_participants(participants, "c1", cut)
            loop.run(engine.aclose())
    finally:
        loop.close()
    [refusal] = cut.refused
    assert refusal.reason == "engine_unavailable" and "e-hung" in refusal.detail
    assert f"no answer within {CONTROL_S:g} s" in refusal.detail
    assert (
        f"engine e-hung did not release its cut calls: no answer within {CONTROL_S:g} s" in resumed
    )


async def _client(url: str) -> EngineClient:
    return EngineClient(url, "hung-engine-token")
