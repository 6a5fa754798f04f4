"""The reference run end to end on real processes (an engine server and three workplace
environment servers): deterministic GRPO steps, a snapshot mid-generation, everything killed
in a later step, a restore onto fresh servers, and the evidence of the restored run checked by
``rollsafe verify`` alone and against an uninterrupted run with the same seed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from reference.rl.controller import Endpoints
from reference.rl.run import ReferenceRun, RunSettings
from rollsafe.evidence import TRAINED, Evidence, FaultRecord, TrainedRow, read_lines
from rollsafe.served import ENGINE_BANNER, ENV_BANNER, ServedProcess, start_served
from rollsafe.verify import verify

ENGINE_TOKEN, ENV_TOKEN = "rr-engine", "rr-env"
INSTANCES = ("w0", "w1", "w2")
SETTINGS = RunSettings(run_id="rr", seed=5, steps=3, group_size=2, groups_per_step=2, turns=4)


class Crash(Exception):
    """The whole run is killed here (servers SIGKILLed, the run's objects dropped)."""


class Servers:
    def __init__(self, logs: Path) -> None:
        self.logs, self.started, self.generation = logs, [], 0

    def start(self) -> Endpoints:
        self.generation += 1
        args = ["engine", "serve", "--port", "0", "--token", ENGINE_TOKEN]
        args += ["--seed", str(SETTINGS.seed), "--model", "dense"]
        engine = self._start(args, ENGINE_BANNER.format(kind="dense"), "engine")
        envs = {}
        for name in INSTANCES:
            args = ["env", "serve", "workplace", "--port", "0", "--token", ENV_TOKEN]
            args += ["--engine-url", engine.url, "--engine-token", ENGINE_TOKEN]
            args += ["--instance", name, "--lease-grace-s", "2"]
            banner = ENV_BANNER.format(name="workplace", instance=name)
            envs[name] = self._start(args, banner, name).url
        return Endpoints(
            engine_url=engine.url, engine_token=ENGINE_TOKEN, envs=envs, env_token=ENV_TOKEN
        )

    def _start(self, args: list[str], banner: str, name: str) -> ServedProcess:
        server = start_served(args, banner, self.logs / f"{name}-{self.generation}")
        self.started.append(server)
        return server

    def crash(self) -> None:
        for server in self.started:
            server.crash()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    running = Servers(tmp_path / "logs")
    try:
        yield running
    finally:
        for server in running.started:
            server.stop()


def uninterrupted(servers: Servers, root: Path) -> Path:
    run = ReferenceRun(SETTINGS, servers.start(), root, root / "out")
    try:
        run.run()
        run.finish()
    finally:
        run.close()
    servers.crash()
    return root / "out"


def test_a_run_crashed_and_restored_trains_the_same_tokens_exactly_once(
    servers: Servers, tmp_path: Path
) -> None:
    reference = uninterrupted(servers, tmp_path / "a")

    root, out = tmp_path / "b", tmp_path / "b" / "out"
    first = ReferenceRun(SETTINGS, servers.start(), root, out)

    def faults(step: int) -> None:
        if step == 1:
            first.snapshot()  # mid-generation: episodes parked, calls cut
        if step == 2:
            servers.crash()
            raise Crash

    try:
        with pytest.raises(Crash):
            first.run(during=faults)
    finally:
        first.close()
    assert [r.published is not None for r in first.snapshots] == [True]
    assert {row.step for row in read_lines(out / TRAINED, TrainedRow)} == {0, 1}

    second, plan = ReferenceRun.restored(SETTINGS, servers.start(), root, out)
    recovered = f"restored from {plan.snapshot} (weight version {plan.weight_version})"
    second.record_fault(FaultRecord(kind="run", where="step2", at_s=0.0, recovered=recovered))
    try:
        assert plan.weight_version == 1 and plan.partial  # step 1's groups were generating
        second.run()
        second.finish()
    finally:
        second.close()

    evidence = Evidence.read(out)
    checks = verify(evidence, Evidence.read(reference))
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert sorted({row.step for row in evidence.trained}) == [0, 1, 2]
    assert {row.step for row in evidence.rolled_back} == {1}  # committed after the snapshot
    # The cut path really ran: some rollout resumed a call from its staged prefix.
    assert sum(row.restored_prefix_tokens for row in evidence.trained) > 0
