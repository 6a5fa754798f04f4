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

Not by default: ``temporal@<phase>`` (the first snapshot to reach that phase is held there
while the Temporal server is SIGKILLed and started again on its state; it then goes on and
publishes) and ``env-lost@step<k>`` (a snapshot mid-generation, then instance
``w2`` SIGKILLed for good: the run is restarted with the fleet that is left, its episodes
restored on the others).

With ``--gym workplace_assistant`` the environments are NeMo Gym's own agent and resources
server behind rollsafe's gateways (:mod:`rollsafe.reference.rl.gym_workplace`).

Then the evidence files are checked (``rollsafe verify``) and ``timeline.png`` drawn. The
run is asynchronous unless ``--deterministic`` (see ``rollsafe.reference.rl.run``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from rollsafe.checkpoint.actor import NAMESPACE, actor_name
from rollsafe.dataplane.tq_runtime import start_local_ray
from rollsafe.engine.loop import HoldRule
from rollsafe.errors import TemporalUnavailable
from rollsafe.evidence.files import (
    GENERATIONS,
    Evidence,
    FaultRecord,
    GenerationEvent,
    append_lines,
)
from rollsafe.evidence.verify import Check, verify
from rollsafe.faults import ENV_VAR
from rollsafe.http.served import ServedProcess, rollsafe_command
from rollsafe.observability.timeline import Span
from rollsafe.reference.rl.controller import Endpoints, ReferenceController
from rollsafe.reference.rl.demo_faults import (
    crash_step,
    fail_env_checkpoint_calls,
    kill_temporal_mid_snapshot,
    snapshot_mid_generation,
    wait_for_kill_moment,
    worker_fault_spec,
)
from rollsafe.reference.rl.demo_options import (
    DEMO_CALL_TOKENS,
    INSTANCES,
    LOST_INSTANCE,
    DemoOptions,
)
from rollsafe.reference.rl.gym_workplace import GYM_INSTANCES, HELD_AFTER_TOKENS, HELD_CALL
from rollsafe.reference.rl.policy import HfModel
from rollsafe.reference.rl.progress import SnapshotWatch, write_timeline
from rollsafe.reference.rl.run import ReferenceRun, run_config
from rollsafe.reference.rl.servers import DEMO_ENGINE_NICENESS, RunServers
from rollsafe.snapshot import SnapshotStore

WORKER_BANNER = r"rollsafe worker: run '(\S+)'"
log = logging.getLogger(__name__)


class ControllerActorProxy:
    """The run's controller actor, called like a :class:`ReferenceController` in this process."""

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
        self.started, self.t0_unix = time.monotonic(), time.time()
        self.spans: list[Span] = []  # steps and faults, for the timeline
        self.tokens = (uuid.uuid4().hex, uuid.uuid4().hex)
        self.workers: list[ServedProcess] = []
        self.faults = {f.kind: f for f in options.faults}
        self.crashed = False
        # temporal@<phase>: the worker holds a snapshot in the phase until this file exists.
        self.temporal_release = self.work / "faults" / f"temporal-release-{uuid.uuid4().hex[:8]}"

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # ---- the processes ---------------------------------------------------------------------

    def start_actor(self, endpoints: Endpoints, *, start_over: bool) -> ControllerActorProxy:
        import ray

        cls: Any = ray.remote(ReferenceController)
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
            start_over=start_over,
            generations=str(self.options.out.resolve() / GENERATIONS),
            workload=self.settings.workload,
        )
        ray.get(handle.status.remote())  # constructed, or its error raised here
        return ControllerActorProxy(handle, actor_name(self.settings.run_id))

    def start_worker(self, env: dict[str, str], *, first: bool = False) -> ServedProcess:
        """A checkpoint worker; the ``first`` one carries the coordinator fault."""
        coordinator = self.faults.get("coordinator") if first else None
        fault = worker_fault_spec(coordinator, self.faults.get("temporal"), self.temporal_release)
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

    def _checkpointer(self, dev: Any) -> Any:
        """The trainer's handle on the run's checkpoint workflows: one at the start, and a
        fresh one after the crash, with the same supervisor settings."""
        from rollsafe.client import Checkpointer

        return Checkpointer(
            self.settings.run_id,
            connection=dev.settings(),
            interval_s=self.options.interval_s,
            max_consecutive_failures=10,
        )

    def _crash_hold(self, crashes: dict[str, int]) -> HoldRule | None:
        """The engine (reference or vLLM) holds the calls of the next step that crashes after
        a snapshot mid-generation (run, env-lost) after their first token until a cut freezes
        them, so that snapshot is sure to cut calls mid-generation, and holds them on after the
        cut (``keep_cut``), so the crash finds them in flight however slow it is (the restore
        then resumes them from their prefixes) instead of hoping to catch some."""
        steps = [step for kind, step in crashes.items() if kind in ("run", "env-lost")]
        if not steps:
            return None
        if self.options.gym is not None:  # the call after the tool effect: see gym_workplace
            return HoldRule(
                calls=HELD_CALL,
                after_tokens=HELD_AFTER_TOKENS,
                from_weight_version=min(steps),
                once=False,
                keep_cut=True,
            )
        return HoldRule(from_weight_version=min(steps), once=False, keep_cut=True)

    def _make_model(self) -> None:
        """--engine vllm: the tiny Hugging Face model the engine serves and the trainer
        trains, built here (nothing can be downloaded), the run's seed its weights'; --gym:
        the model the trainer trains (its tokenizer the gateways'), and the engine's script."""
        model = self.settings.model
        if not isinstance(model, HfModel):
            return
        from rollsafe.engine.vllm.models import ModelSpec, make_model

        if self.options.script_path is None:
            make_model(model.path, ModelSpec(arch="dense", seed=self.settings.seed))
            return
        from rollsafe.reference.rl.gym_workplace import MODEL_SPEC, script

        make_model(model.path, MODEL_SPEC.model_copy(update={"seed": self.settings.seed}))
        self.options.script_path.write_text(json.dumps(script(), indent=2) + "\n")

    def _environments(self) -> str:
        count = len(self.servers.instances)
        if self.options.gym is None:
            return f"{count} environments"
        from rollsafe.gym.servers import ENVIRONMENT_SERVERS_SINCE, gym_version

        version = gym_version()  # GymServers puts legacy_agent in front where it exists
        agent = (
            "legacy_agent + simple_agent"
            if version >= ENVIRONMENT_SERVERS_SINCE
            else "simple_agent"
        )
        release = ".".join(map(str, version))
        return f"{count} environments (gateway + NeMo Gym {release} {self.options.gym} + {agent})"

    def stop_workers(self) -> None:
        for worker in self.workers:
            worker.stop()

    def record(self, fault: FaultRecord) -> None:
        self.pending_faults.append(fault)

    # ---- the run ---------------------------------------------------------------------------

    def run(self) -> list[Check]:
        import ray

        from rollsafe.temporal.devserver import DevServer

        self.pending_faults: list[FaultRecord] = []
        with ExitStack() as stack:
            dev = DevServer(self.work / "temporal")
            asyncio.run(dev.start())
            stack.callback(dev.stop)
            start_local_ray(namespace=NAMESPACE, log_to_driver=False)
            stack.callback(ray.shutdown)
            self.dev, self.temporal = dev, dev.settings()
            self.temporal_release.parent.mkdir(parents=True, exist_ok=True)
            env = {
                "TEMPORAL_ADDRESS": dev.address,
                "TEMPORAL_NAMESPACE": dev.namespace,
                "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
            }
            servers = RunServers(
                self.work / "logs",
                GYM_INSTANCES if self.options.gym is not None else INSTANCES,
                seed=self.settings.seed,
                engine_token=self.tokens[0],
                env_token=self.tokens[1],
                max_tokens=DEMO_CALL_TOKENS,
                model=self.settings.model,
                snapshot_root=(self.work / "snapshots").resolve(),
                engine_niceness=DEMO_ENGINE_NICENESS,
                script=self.options.script_path,
            )
            stack.callback(servers.stop)
            self.servers = servers
            self._make_model()
            stack.callback(self.stop_workers)
            crashes = {
                kind: step
                for kind in ("run", "kill", "env-lost")
                if (step := crash_step(self.faults.get(kind))) is not None
            }
            endpoints = servers.start(hold=self._crash_hold(crashes))
            self.say(
                f"[start] Temporal {dev.address}, Ray, engine, {self._environments()} "
                f"({self.elapsed():.1f}s)"
            )
            # A new run: snapshots a previous demo left in --out are not its own to restore.
            controller = self.start_actor(endpoints, start_over=True)
            self.start_worker(env, first=True)
            checkpointer = self._checkpointer(dev)
            asyncio.run(checkpointer.start())
            run = ReferenceRun(self.settings, endpoints, self.work, self.options.out, controller)
            run.listener = CheckpointerListener(checkpointer)
            stack.enter_context(self.worker_watch(env))
            with SnapshotWatch(
                self.temporal, self.settings.run_id, self.t0_unix, self.say
            ) as watch:
                while True:
                    try:
                        self._steps(run, checkpointer, endpoints, crashes)
                        break
                    except _Crash as crash:
                        del crashes[crash.kind]
                        hold = self._crash_hold(crashes)  # for a crash still to come
                        run, endpoints, checkpointer = self._recover(
                            run, servers, env, dev, crash, hold
                        )
            self._finish(run, watch.parks)
        return verify(Evidence.read(self.options.out))

    def _finish(self, run: ReferenceRun, parks: list[float]) -> None:
        """The faults, handed_out.jsonl, report.json and timeline.png."""
        for fault in self.pending_faults:
            run.record_fault(fault)
            end = fault.at_s + (fault.recovery_s or 0.0)
            label = f"{fault.kind}@{fault.where}"
            self.spans.append(Span(kind="fault", label=label, start_s=fault.at_s, end_s=end))
        published = SnapshotStore(self.work / "snapshots", self.settings.run_id).list()
        totals = {
            "snapshots_published": float(len(published)),
            "snapshots_parked": float(len(parks)),
            "park_s_max": max(parks, default=0.0),
            "park_s_median": statistics.median(parks) if parks else 0.0,
            "seconds": self.elapsed(),
        }
        run.finish(totals=totals)
        run.close()
        mode = "deterministic" if self.settings.deterministic else f"{self.settings.sampler}"
        title = f"rollsafe demo: run {self.settings.run_id}, {mode}, {run.step} steps"
        path = write_timeline(
            self.temporal, self.settings.run_id, self.t0_unix, self.spans, self.options.out, title
        )
        self.say(f"[done] {run.step} steps in {self.elapsed():.1f}s; timeline: {path}")

    def _steps(
        self, run: ReferenceRun, checkpointer: Any, endpoints: Endpoints, crashes: dict[str, int]
    ) -> None:
        def during(step: int) -> None:
            if "temporal" in self.faults and not self.temporal_release.exists():  # not yet
                store = SnapshotStore(self.work / "snapshots", self.settings.run_id)
                fault, release = self.faults["temporal"], self.temporal_release
                self.record(
                    kill_temporal_mid_snapshot(
                        self.dev, fault, release, store, self.say, self.elapsed
                    )
                )
            if step == crashes.get("kill"):
                rollouts = self.settings.groups_per_step * self.settings.group_size
                moment = random.Random(self.settings.seed).randint(1, max(1, rollouts - 1))
                store = SnapshotStore(self.work / "snapshots", self.settings.run_id)
                sealed = wait_for_kill_moment(self.options.out / GENERATIONS, store, moment)
                # A restore starts at a trainer checkpoint at or past its snapshot: when every
                # snapshot is past them (the first one skipped, its worker killed while a step
                # committed), the trainer checkpoints now, as a real one does every few steps.
                versions = [m.weight_version for m in store.published_manifests()]
                if versions and min(versions) > max(run.anchors()):
                    run.anchor_now()
                raise _Crash("kill", f"{sealed} rollouts sealed since step {step + 1} began")
            if step == 1 and "env" in self.faults:
                self.record(
                    fail_env_checkpoint_calls(
                        endpoints,
                        checkpointer,
                        self.temporal,
                        self.settings.run_id,
                        self.say,
                        self.elapsed,
                    )
                )
            if step == crashes.get("run"):
                snapshot_mid_generation(run, checkpointer, self.say, self.elapsed)
                raise _Crash("run", "mid-generation, just after a snapshot")
            if step == crashes.get("env-lost"):
                snapshot_mid_generation(run, checkpointer, self.say, self.elapsed)
                self.servers.lose(LOST_INSTANCE)
                self.say(
                    f"[fault] environment {LOST_INSTANCE} is lost for good ({self.elapsed():.1f}s)"
                )
                raise _Crash("env-lost", f"without {LOST_INSTANCE}, just after a snapshot")

        while run.step < run.settings.steps:
            step, began = run.step, self.elapsed()
            results = run.run(until_step=step + 1, during=during)
            result, ended = results[-1], self.elapsed()
            label = f"step {step + 1}"
            self.spans.append(Span(kind="step", label=label, start_s=began, end_s=ended))
            rollouts = self.settings.groups_per_step * self.settings.group_size
            self.say(
                f"[step {step + 1}/{run.settings.steps}] loss {result.loss:+.4f}, reward "
                f"{result.mean_reward:.2f}, {result.n_tokens} tokens, "
                f"{rollouts / (ended - began):.2f} rollouts/s ({ended:.1f}s)"
            )

    def _recover(
        self,
        run: ReferenceRun,
        servers: RunServers,
        env: dict[str, str],
        dev: Any,
        crash: _Crash,
        hold: HoldRule | None,
    ) -> tuple[ReferenceRun, Endpoints, Any]:
        """Everything restarted and the run restored: the new run, its servers' endpoints
        and its checkpointer (the old ones point at killed processes). ``hold``: the engine's
        hold for a crash still to come."""
        at = self.elapsed()
        self.crashed = True
        self.say(f"[fault] the whole run is killed {crash.detail} ({at:.1f}s)")
        killed = GenerationEvent(event="killed", at_unix=time.time())
        append_lines(self.options.out / GENERATIONS, [killed])
        servers.crash()
        for worker in self.workers:
            worker.crash()
        assert isinstance(run.controller, ControllerActorProxy)
        run.controller.kill()
        run.abandon()
        lost = crash.kind == "env-lost"
        fleet = [name for name in servers.instances if name != LOST_INSTANCE] if lost else None
        endpoints = servers.start(hold=hold, instances=fleet)
        # The run has published snapshots: until its restore the new controller is fenced,
        # so a periodic snapshot of its empty state cannot displace the real one.
        controller = self.start_actor(endpoints, start_over=False)
        self.start_worker(env)
        self.crashed = False
        restore_id = f"r-{uuid.uuid4().hex[:6]}"
        checkpointer = self._checkpointer(dev)
        # Only a snapshot at a weight version the trainer checkpointed can be restored.
        plan = asyncio.run(checkpointer.restore(restore_id, weight_versions=run.anchors()))
        restored = ReferenceRun(self.settings, endpoints, self.work, self.options.out, controller)
        restored.resume_from(plan, restore_id)
        asyncio.run(checkpointer.start())
        restored.listener = CheckpointerListener(checkpointer)
        resumed = sum(len(g.resumed) for g in plan.partial.values())
        for name, why in plan.environments_failed.items():
            self.say(f"[restore] {name} could not restore its episodes (restarted instead): {why}")
        for name, what in plan.environments_lost.items():
            self.say(f"[restore] {name} is {what}")
        journal = f" + {plan.journal.records} journal records" if plan.journal else ""
        self.say(
            f"[restore] {plan.snapshot}{journal}: weight version {plan.weight_version}, "
            f"{len(plan.ready)} groups ready, {resumed} episodes resumed "
            f"({self.elapsed():.1f}s)"
        )
        onto = f" onto {', '.join(endpoints.envs)}" if lost else ""
        self.record(
            FaultRecord(
                kind=crash.kind,
                where=f"step{run.step + 1}",
                at_s=at,
                recovered=f"everything restarted; restored {plan.snapshot}{onto}",
                recovery_s=self.elapsed() - at,
            )
        )
        return restored, endpoints, checkpointer


class _Crash(Exception):
    """Every process of the run is to be killed: ``kind`` the fault (run, kill)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


class CheckpointerListener:
    """The trainer tells the checkpoint workflows of its steps and checkpoints (the SDK): a
    committed step aborts a snapshot that has not captured yet (it would be stale), and a
    trainer checkpoint asks for a snapshot anchored at it."""

    # A notice the server did not take in time (TemporalUnavailable: transient) is sent
    # again, as the SDK's errors say to; both notices are idempotent.
    ATTEMPTS = 3

    def __init__(self, checkpointer: Any) -> None:
        self.checkpointer = checkpointer

    def step_committed(self, step: int) -> None:
        # One signal; a snapshot it made stale shows as skipped in the snapshot watch.
        self._notify(lambda: self.checkpointer.train_step_committed(step))

    def checkpoint_saved(self, weight_version: int, path: Path) -> None:
        self._notify(lambda: self.checkpointer.trainer_checkpoint_saved(weight_version, str(path)))

    def _notify(self, notice: Callable[[], Coroutine[Any, Any, object]]) -> None:
        for attempt in range(1, self.ATTEMPTS + 1):
            try:
                asyncio.run(notice())
                return
            except TemporalUnavailable as exc:
                if attempt == self.ATTEMPTS:
                    raise
                log.warning("trainer notice not taken (attempt %d): %s", attempt, exc)


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
