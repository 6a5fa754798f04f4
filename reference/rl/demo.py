"""``rollsafe demo``: the reference run on every real part, with faults, ending in a verdict.

Starts the embedded Temporal dev server, a local Ray, the engine and three workplace
environment servers, the run's controller as its named Ray actor, and a checkpoint worker
process; the trainer runs here. Snapshots are Temporal workflows (a supervisor on a timer,
plus one taken mid-generation before a planned crash). The default faults:

- ``coordinator@<phase>``: the first checkpoint worker dies (``os._exit``) inside that phase of
  the first snapshot to reach it; a new worker is started and the snapshot finishes from the
  workflow's history;
- ``run@step<k>``: while step k's episodes are generating (right after a snapshot), every
  process of the run is SIGKILLed and the controller actor killed; everything is started
  again and the run restored from its newest snapshot through the RestoreRun workflow;
- ``env@prepare``: instance ``w1`` answers 503 to the checkpoint protocol for a moment, so a
  snapshot's prepare fails and is retried by Temporal.

Then the evidence files are checked (``rollsafe verify``). Deterministic mode only, for now:
each step's groups are generated with that step's weights (see ``reference.rl.run``).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from reference.rl.controller import Endpoints, RunController
from reference.rl.run import ReferenceRun, RunSettings, run_config
from reference.rl.servers import RunServers
from rollsafe.actor import NAMESPACE, actor_name
from rollsafe.errors import InvalidInput
from rollsafe.evidence import Evidence, FaultRecord
from rollsafe.faults import ENV_VAR
from rollsafe.phases import PHASES
from rollsafe.served import ServedProcess, rollsafe_command
from rollsafe.snapshot import SnapshotStore
from rollsafe.verify import Check, verify

INSTANCES = ("w0", "w1", "w2")
# Calls long enough, and enough of them at once, that a snapshot taken while a step generates
# finds calls mid-generation to cut (prepare and drain come first, and calls go on meanwhile).
DEMO_TURNS, DEMO_GROUP_SIZE, DEMO_CALL_TOKENS = 6, 4, 48
DEFAULT_FAULTS = ("coordinator@capture", "run@step3", "env@prepare")
WORKER_BANNER = r"rollsafe worker: run '(\S+)'"
_FAULT = re.compile(r"(coordinator|run|env)@(\S+)")


class Fault(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["coordinator", "run", "env"]
    where: str

    @classmethod
    def parse(cls, text: str) -> Fault:
        match = _FAULT.fullmatch(text)
        if match is None:
            raise InvalidInput(
                f"fault {text!r}: expected KIND@WHERE, KIND one of coordinator, run, env"
            )
        kind, where = match.groups()
        phases = [p.value for p in PHASES]
        if kind == "coordinator" and where not in phases:
            raise InvalidInput(f"fault {text!r}: the phase must be one of {', '.join(phases)}")
        if kind == "run" and not re.fullmatch(r"step[1-9][0-9]*", where):
            raise InvalidInput(f"fault {text!r}: expected run@step<k>, k >= 1")
        if kind == "env" and where != "prepare":
            raise InvalidInput(f"fault {text!r}: only env@prepare is available")
        return cls.model_validate({"kind": kind, "where": where})

    def __str__(self) -> str:
        return f"{self.kind}@{self.where}"


class DemoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    out: Path
    steps: int = Field(default=6, ge=1)
    seed: int = 0
    restore_level: Literal["prefix", "turn", "sibling", "prompt_group"] = "prefix"
    faults: tuple[Fault, ...] = tuple(Fault.parse(f) for f in DEFAULT_FAULTS)
    interval_s: float = Field(default=3.0, gt=0)

    @field_validator("faults")
    @classmethod
    def _one_each(cls, faults: tuple[Fault, ...]) -> tuple[Fault, ...]:
        kinds = [f.kind for f in faults]
        if len(set(kinds)) != len(kinds):
            raise ValueError("at most one fault of each kind")
        return faults

    @model_validator(mode="after")
    def _crash_within_the_run(self) -> DemoOptions:
        for fault in self.faults:
            if fault.kind == "run" and int(fault.where[4:]) > self.steps:
                raise ValueError(f"{fault}: the run has only {self.steps} steps")
        return self

    def settings(self) -> RunSettings:
        # The run id is the seed's: rollouts are named after it, and sampling is keyed by the
        # rollout, so two runs with one seed can be compared rollout by rollout (--against).
        return RunSettings(
            run_id=f"demo-s{self.seed}",
            seed=self.seed,
            steps=self.steps,
            turns=DEMO_TURNS,
            group_size=DEMO_GROUP_SIZE,
            restore_level=self.restore_level,
        )


class ActorController:
    """The run's controller actor, called like a :class:`RunController` in this process."""

    def __init__(self, handle: Any, name: str) -> None:
        self.handle, self.name = handle, name

    def __getattr__(self, method: str) -> Callable[..., Any]:
        import ray

        remote = getattr(self.handle, method)
        return lambda *args, **kwargs: ray.get(remote.remote(*args, **kwargs))

    def close(self) -> None:
        import ray

        ray.get(self.handle.close.remote())
        self.kill()

    def kill(self) -> None:
        """As a crash would: no goodbye. Returns once the run's actor name is free again."""
        import ray

        ray.kill(self.handle)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                ray.get_actor(self.name, namespace=NAMESPACE)
            except ValueError:
                return
            time.sleep(0.1)


class Demo:
    def __init__(self, options: DemoOptions, say: Callable[[str], None]) -> None:
        self.options, self.say = options, say
        self.settings = options.settings()
        self.work = options.out.resolve() / "work"
        self.started = time.monotonic()
        self.tokens = (uuid.uuid4().hex, uuid.uuid4().hex)
        self.workers: list[ServedProcess] = []
        self.faults = {f.kind: f for f in options.faults}
        self.crashed = False

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # ---- the processes ---------------------------------------------------------------------

    def start_actor(self, endpoints: Endpoints, *, awaiting_restore: bool) -> ActorController:
        import ray

        cls: Any = ray.remote(RunController)
        handle = cls.options(
            name=actor_name(self.settings.run_id),
            namespace=NAMESPACE,
            max_concurrency=16,
            num_cpus=0,
        ).remote(
            run_config(self.settings),
            str(self.work / "snapshots"),
            endpoints,
            self.settings.turns,
            awaiting_restore=awaiting_restore,
        )
        ray.get(handle.status.remote())  # constructed, or its error raised here
        return ActorController(handle, actor_name(self.settings.run_id))

    def start_worker(self, env: dict[str, str], fault: str | None = None) -> ServedProcess:
        extra = {ENV_VAR: fault} if fault else {}
        logs = self.work / "logs" / f"worker-{len(self.workers)}"
        command = rollsafe_command("worker", "--run", self.settings.run_id)
        worker = ServedProcess(command, logs, {**env, **extra}).wait_listening(WORKER_BANNER)
        self.workers.append(worker)
        return worker

    @contextmanager
    def worker_watch(self, env: dict[str, str]) -> Iterator[None]:
        """Replaces a checkpoint worker that died (the coordinator fault) and records it."""
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.2):
                if self.workers and not self.workers[-1].alive() and not self.crashed:
                    died = self.elapsed()
                    self.say(
                        f"[fault] checkpoint worker died inside a snapshot phase ({died:.1f}s)"
                    )
                    self.start_worker(env)
                    fault = self.faults["coordinator"]
                    self.record(
                        FaultRecord(
                            kind="coordinator",
                            where=fault.where,
                            at_s=died,
                            recovered="a new worker took over; the snapshot continued from history",
                            recovery_s=self.elapsed() - died,
                        )
                    )

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def stop_workers(self) -> None:
        for worker in self.workers:
            worker.stop()

    def record(self, fault: FaultRecord) -> None:
        self.pending_faults.append(fault)

    # ---- the run ---------------------------------------------------------------------------

    def run(self) -> list[Check]:
        import ray

        from rollsafe.client import Checkpointer
        from rollsafe.temporal.devserver import DevServer

        self.pending_faults: list[FaultRecord] = []
        with ExitStack() as stack:
            dev = DevServer(self.work / "temporal")
            asyncio.run(dev.start())
            stack.callback(dev.stop)
            ray.init(
                num_cpus=4,
                include_dashboard=False,
                object_store_memory=128 << 20,
                namespace=NAMESPACE,
                log_to_driver=False,
            )
            stack.callback(ray.shutdown)
            self.temporal = dev.settings()
            env = {
                "TEMPORAL_ADDRESS": dev.address,
                "TEMPORAL_NAMESPACE": dev.namespace,
                "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
            }
            servers = RunServers(
                self.work / "logs",
                INSTANCES,
                seed=self.settings.seed,
                engine_token=self.tokens[0],
                env_token=self.tokens[1],
                max_tokens=DEMO_CALL_TOKENS,
            )
            stack.callback(servers.stop)
            stack.callback(self.stop_workers)
            endpoints = servers.start()
            self.say(
                f"[start] Temporal {dev.address}, Ray, engine, {len(INSTANCES)} environments "
                f"({self.elapsed():.1f}s)"
            )
            controller = self.start_actor(endpoints, awaiting_restore=False)
            coordinator = self.faults.get("coordinator")
            fault_spec = f"worker.phase.{coordinator.where}.before:exit" if coordinator else None
            self.start_worker(env, fault_spec)
            checkpointer = Checkpointer(
                self.settings.run_id,
                settings=dev.settings(),
                interval_s=self.options.interval_s,
                max_consecutive_failures=10,
            )
            asyncio.run(checkpointer.start())
            run = ReferenceRun(self.settings, endpoints, self.work, self.options.out, controller)
            stack.enter_context(self.worker_watch(env))
            crash = self.faults.get("run")
            crash_step = int(crash.where[4:]) - 1 if crash else None  # run@step<k>: 1-based
            while True:
                try:
                    self._steps(run, checkpointer, endpoints, crash_step)
                    break
                except _Crash:
                    run = self._recover(run, servers, env, dev)
                    crash_step = None
            for fault in self.pending_faults:
                run.record_fault(fault)
            published = SnapshotStore(self.work / "snapshots", self.settings.run_id).list()
            run.finish(totals={"snapshots_published": float(len(published))})
            run.close()
        return verify(Evidence.read(self.options.out))

    def _steps(
        self, run: ReferenceRun, checkpointer: Any, endpoints: Endpoints, crash_step: int | None
    ) -> None:
        def during(step: int) -> None:
            if step == 1 and "env" in self.faults:
                self._env_fault(endpoints, checkpointer)
            if step == crash_step:
                self._snapshot_mid_generation(run, checkpointer)
                raise _Crash

        while run.step < run.settings.steps:
            step = run.step
            results = run.run(until_step=step + 1, during=during)
            result = results[-1]
            self.say(
                f"[step {step + 1}/{run.settings.steps}] loss {result.loss:+.4f}, reward "
                f"{result.mean_reward:.2f}, {result.n_tokens} tokens ({self.elapsed():.1f}s)"
            )

    def _snapshot_mid_generation(self, run: ReferenceRun, checkpointer: Any) -> None:
        """Snapshots while the step's calls generate, until one cut a call (a few tries: a
        snapshot that parks every episode between two calls cuts nothing)."""
        deadline = time.monotonic() + 10
        while run.loop.run(run.engine.info()).active == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(4):
            outcome = asyncio.run(checkpointer.snapshot_now(timeout=120))
            cut = sum(p.counts.get("cut", 0) for p in outcome.phases)
            self.say(
                f"[snapshot] {outcome.seq} {outcome.status} mid-generation, {cut} calls cut "
                f"({self.elapsed():.1f}s)"
            )
            if outcome.status == "published" and cut:
                return

    def _env_fault(self, endpoints: Endpoints, checkpointer: Any) -> None:
        """w1 answers 503 to the checkpoint protocol until a snapshot's prepare failed on it
        (its workflow is then in ``resume``, retrying w1's resume): the other instances were
        resumed and refuse that checkpoint id forever, so the snapshot fails (transient) and
        the next one, once w1 answers again, publishes."""
        url = endpoints.envs["w1"]
        headers = {"authorization": f"Bearer {endpoints.env_token}"}
        httpx.post(f"{url}/faults", json={"unavailable": True}, headers=headers).raise_for_status()
        at = self.elapsed()
        self.say(f"[fault] environment w1 fails its checkpoint calls ({at:.1f}s)")
        outcomes: list[Any] = []
        snapshot = threading.Thread(
            target=lambda: outcomes.append(asyncio.run(checkpointer.snapshot_now(timeout=120)))
        )
        snapshot.start()
        try:
            asyncio.run(self._until_a_snapshot_resumes())
        finally:
            httpx.post(f"{url}/faults", json={}, headers=headers).raise_for_status()
            snapshot.join()
        failed = outcomes[0]
        self.say(f"[snapshot] {failed.seq} {failed.status}: {failed.reason[:90]}")
        again = asyncio.run(checkpointer.snapshot_now(timeout=120))
        self.say(f"[snapshot] {again.seq} {again.status} ({self.elapsed():.1f}s)")
        recovered = f"snapshot {failed.seq} {failed.status}; snapshot {again.seq} {again.status}"
        self.record(
            FaultRecord(
                kind="env",
                where="prepare",
                at_s=at,
                recovered=f"{recovered} once w1 answered again",
                recovery_s=self.elapsed() - at,
            )
        )

    async def _until_a_snapshot_resumes(self, timeout_s: float = 60.0) -> None:
        from rollsafe.inspect import inspect_run
        from rollsafe.temporal.connect import connect

        client = await connect(self.temporal)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            view = await inspect_run(client, self.settings.run_id)
            if any(snapshot.phase == "resume" for snapshot in view.snapshots):
                return
            await asyncio.sleep(0.1)

    def _recover(
        self, run: ReferenceRun, servers: RunServers, env: dict[str, str], dev: Any
    ) -> ReferenceRun:
        from rollsafe.client import Checkpointer

        at = self.elapsed()
        self.crashed = True
        self.say(f"[fault] the whole run is killed mid-generation ({at:.1f}s)")
        servers.crash()
        for worker in self.workers:
            worker.crash()
        assert isinstance(run.controller, ActorController)
        run.controller.kill()
        run.abandon()
        endpoints = servers.start()
        # Until its restore, a periodic snapshot of its empty state must not happen.
        controller = self.start_actor(endpoints, awaiting_restore=True)
        self.start_worker(env)
        self.crashed = False
        restore_id = f"restore-{uuid.uuid4().hex[:6]}"
        checkpointer = Checkpointer(
            self.settings.run_id,
            settings=dev.settings(),
            interval_s=self.options.interval_s,
            max_consecutive_failures=10,
        )
        plan = asyncio.run(checkpointer.restore(restore_id))
        restored = ReferenceRun(self.settings, endpoints, self.work, self.options.out, controller)
        restored.resume_from(plan, restore_id)
        asyncio.run(checkpointer.start())
        resumed = sum(len(g.resumed) for g in plan.partial.values())
        self.say(
            f"[restore] {plan.snapshot}: weight version {plan.weight_version}, {len(plan.ready)} "
            f"groups ready, {resumed} episodes resumed on their instances ({self.elapsed():.1f}s)"
        )
        self.record(
            FaultRecord(
                kind="run",
                where=f"step{run.step + 1}",
                at_s=at,
                recovered=f"everything restarted; restored {plan.snapshot}",
                recovery_s=self.elapsed() - at,
            )
        )
        return restored


class _Crash(Exception):
    pass


def run_demo(options: DemoOptions, say: Callable[[str], None] = print) -> list[Check]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # SIGTERM (a timeout, an operator) unwinds like Ctrl-C, so every process started here is
    # stopped by its pid on the way out.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return Demo(options, say).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
