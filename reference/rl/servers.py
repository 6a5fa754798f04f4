"""The reference run's server processes: one ``rollsafe engine serve`` and the environment
instances, each ``rollsafe env serve workplace`` (or another built-in environment: ``completion``)
or, with a script (``demo --gym``), a gateway in front of NeMo Gym's own agent and resources
server; started fresh, killed by pid (a crash is SIGKILL), stopped by pid at the end."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol

from rollsafe.engine.loop import HOLD_ENV, HoldRule
from rollsafe.engine.model import ModelConfig
from rollsafe.http.bearer import ENGINE_TOKEN_ENV, ENV_TOKEN_ENV
from rollsafe.http.served import (
    ENGINE_BANNER,
    ENV_BANNER,
    START_TIMEOUT_S,
    ServedProcess,
    start_served,
)
from rollsafe.reference.rl.controller import Endpoints
from rollsafe.reference.rl.policy import HfModel, PolicyModel

ENGINE_START_S = 240.0  # vLLM: import it and load the model, on a busy 2-core machine
# The demo's reference engine generates on every core it gets; on GPUs generation does not take
# the CPUs the run's control plane (environments, worker, Temporal) answers a snapshot with. A
# lower CPU priority keeps that so on a CPU-only machine (measured: docs/benchmarks.md, the park
# window through Temporal). Only where one run has the machine (`rollsafe demo`): beside other
# work the engine starves (a test waiting for a call to start timed out, on a machine running
# more tests). Not vLLM: its cut waits for the running step, which a lower priority lengthens.
DEMO_ENGINE_NICENESS = 10
Environment = Literal["workplace", "completion"]  # built-in environments (rollsafe env serve)


class _Process(Protocol):
    def crash(self) -> None: ...
    def stop(self) -> None: ...


class RunServers:
    def __init__(  # noqa: PLR0913 (the reference run's servers, one keyword each)
        self,
        logs: Path,
        instances: Sequence[str],
        *,
        seed: int,
        engine_token: str,
        env_token: str,
        env_faults: Mapping[str, str] | None = None,
        max_tokens: int = 12,
        model: PolicyModel | None = None,
        snapshot_root: Path | None = None,
        engine_niceness: int = 0,
        script: Path | None = None,
        environment: Environment = "workplace",
    ) -> None:
        self.logs, self.instances, self.seed = logs, tuple(instances), seed
        self.engine_token, self.env_token = engine_token, env_token
        self.env_faults = dict(env_faults or {})  # instance -> --faults spec, first start only
        self.max_tokens = max_tokens  # per policy call
        self.model = model or ModelConfig()  # the trainer's: the engine serves the same one
        self.snapshot_root = snapshot_root  # the environments' commit/restore paths stay inside
        self.engine_niceness = engine_niceness  # the reference engine's (vLLM's stays 0)
        # The scripted policy's replies: NeMo Gym's agents behind gateways (``model`` is then
        # the Hugging Face directory whose tokenizer they share).
        self.script = script
        self.environment = environment  # what each instance serves (completion: max_tokens unused)
        self.started: list[_Process] = []
        self.current: list[_Process] = []
        self.current_envs: dict[str, _Process] = {}  # this generation's, by instance
        self.generation = 0
        self.engine_url = ""  # the current engine's, once started

    def start(
        self, hold: HoldRule | None = None, instances: Sequence[str] | None = None
    ) -> Endpoints:
        """Fresh servers; ``hold``: the engine holds the calls it names (a test instrument,
        ``ROLLSAFE_ENGINE_HOLD``); ``instances``: this fleet from now on (one lost for good,
        one added), instead of the one before."""
        if instances is not None:
            self.instances = tuple(instances)
        self.generation += 1
        self.current, self.current_envs = [], {}
        # Tokens through the environment, never argv (`ps` shows argv to every user).
        tokens = {ENGINE_TOKEN_ENV: self.engine_token, ENV_TOKEN_ENV: self.env_token}
        args = ["engine", "serve", "--port", "0", *self._engine_args()]
        hold_env = {HOLD_ENV: hold.model_dump_json()} if hold is not None else {}
        banner = ENGINE_BANNER.format(kind=r"\S+")
        niceness = 0 if isinstance(self.model, HfModel) else self.engine_niceness
        engine_env = {**tokens, **hold_env}
        engine = self._start(args, banner, "engine", engine_env, ENGINE_START_S, niceness)
        self.engine_url = engine.url
        return self._start_envs()

    def restart_environments(self) -> Endpoints:
        """SIGKILL this generation's environment instances and start fresh ones on the same
        engine (a crash that takes the trainer's node and its environments, not the engine)."""
        for server in self.current_envs.values():
            server.crash()
        self.generation += 1
        self.current = [p for p in self.current if p not in self.current_envs.values()]
        self.current_envs = {}
        return self._start_envs()

    def _start_envs(self) -> Endpoints:
        tokens = {ENGINE_TOKEN_ENV: self.engine_token, ENV_TOKEN_ENV: self.env_token}
        envs = {name: self._start_env(name, self.engine_url, tokens) for name in self.instances}
        return Endpoints(
            engine_url=self.engine_url,
            engine_token=self.engine_token,
            envs=envs,
            env_token=self.env_token,
        )

    def _start_env(self, name: str, engine_url: str, tokens: Mapping[str, str]) -> str:
        """Instance ``name``, started and listening; returns its URL."""
        if self.script is not None:
            return self._start_gym(name, engine_url, tokens)
        args = ["env", "serve", self.environment, "--port", "0", "--engine-url", engine_url]
        args += ["--instance", name, "--lease-grace-s", "5"]
        if self.environment == "workplace":  # a completion's tokens are its task's
            args += ["--max-tokens", str(self.max_tokens)]
        if self.snapshot_root is not None:
            args += ["--snapshot-root", str(self.snapshot_root)]
        if self.generation == 1 and name in self.env_faults:
            args += ["--faults", self.env_faults[name]]
        banner = ENV_BANNER.format(name=self.environment, instance=name)
        server = self._start(args, banner, name, tokens)
        self.current_envs[name] = server
        return server.url

    def _start_gym(self, name: str, engine_url: str, tokens: Mapping[str, str]) -> str:
        from rollsafe.reference.rl.gym_workplace import start_instance

        assert isinstance(self.model, HfModel)
        logs = self.logs / f"{name}-{self.generation}"
        gateway, gym = start_instance(
            name, engine_url, self.model.path, logs, tokens, self.snapshot_root
        )
        for process in (gateway, gym):
            self.started.append(process)
            self.current.append(process)
        self.current_envs[name] = gateway
        return gateway.url

    def _engine_args(self) -> list[str]:
        if self.script is not None:
            assert isinstance(self.model, HfModel)
            model, script = str(self.model.path), str(self.script)
            return ["--backend", "scripted", "--model", model, "--script", script]
        if isinstance(self.model, HfModel):  # float32: the dtype exact resume holds in
            return ["--backend", "vllm", "--model", str(self.model.path)]
        return ["--seed", str(self.seed), "--model", self.model.kind]

    def _start(
        self,
        args: list[str],
        banner: str,
        name: str,
        env: Mapping[str, str],
        timeout_s: float = START_TIMEOUT_S,
        niceness: int = 0,
    ) -> ServedProcess:
        logs = self.logs / f"{name}-{self.generation}"
        server = start_served(args, banner, logs, env=env, timeout_s=timeout_s, niceness=niceness)
        self.started.append(server)
        self.current.append(server)
        return server

    def crash(self) -> None:
        for server in self.current:
            server.crash()

    def lose(self, instance: str) -> None:
        """SIGKILL one environment instance, as a lost node would end it; the next
        :meth:`start` names the fleet without it."""
        self.current_envs[instance].crash()

    def stop(self) -> None:
        for server in self.started:
            server.stop()
