"""What ``rollsafe demo`` is asked to do: its options and the faults it injects."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollsafe.core.config import RestoreLevelName, SamplerName
from rollsafe.core.phases import PHASES
from rollsafe.engine.model import ModelConfig
from rollsafe.errors import InvalidInput
from rollsafe.gym.servers import GymEnvironment
from rollsafe.reference.rl.policy import HfModel
from rollsafe.reference.rl.run import RunSettings

INSTANCES = ("w0", "w1", "w2")
# Calls long enough, and enough of them at once, that a snapshot taken while a step generates
# finds calls mid-generation to cut (prepare and drain come first, and calls go on meanwhile).
DEMO_TURNS, DEMO_GROUP_SIZE, DEMO_CALL_TOKENS = 6, 4, 48
DEFAULT_FAULTS = ("coordinator@capture", "kill@step2", "run@step3", "env@prepare")
# --gym: a kill mid-episode after its tool effect, mid-generation (run: the call after the
# mutation is held, the snapshot cuts it), and one between snapshots (kill: the journal).
DEFAULT_GYM_FAULTS = ("coordinator@capture", "run@step2", "kill@step3")
# Faults a gym run cannot take: its gateways have no fault switches (env@prepare), and the
# demo runs two instances, not three (env-lost).
_NOT_WITH_GYM = ("env", "env-lost")
# rollsafe demo --engine vllm: the tiny dense model it builds (engine make-model) and serves,
# one per seed (the seed draws its weights).
MODEL_DIR = "work/model-s{seed}"
# --gym: the tiny model the trainer trains, whose tokenizer the gateways and the scripted
# engine use; and the scripted engine's replies.
GYM_MODEL_DIR, GYM_SCRIPT = "work/gym-model-s{seed}", "work/gym-script.json"
_FAULT = re.compile(r"(coordinator|run|kill|env-lost|env|temporal)@(\S+)")
KINDS = "coordinator, run, kill, env, temporal, env-lost"
# Faults that end the run's processes at a step: one per step.
_AT_STEP = ("run", "kill", "env-lost")
# The environment instance env-lost@step<k> kills for good.
LOST_INSTANCE = INSTANCES[-1]
_STEP = re.compile(r"step[1-9][0-9]*")


class Fault(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # run: a snapshot mid-generation, then every process killed; kill: every process killed
    # at a random moment between two snapshots (what the journal is for); temporal: the
    # Temporal server SIGKILLed while a snapshot is in a phase, started again on its state;
    # env-lost: a snapshot mid-generation, then an environment instance killed for good and
    # the run restored onto the others.
    kind: Literal["coordinator", "run", "kill", "env", "temporal", "env-lost"]
    where: str

    @classmethod
    def parse(cls, text: str) -> Fault:
        match = _FAULT.fullmatch(text)
        if match is None:
            raise InvalidInput(f"fault {text!r}: expected KIND@WHERE, KIND one of {KINDS}")
        kind, where = match.groups()
        phases = [p.value for p in PHASES]
        if kind in ("coordinator", "temporal") and where not in phases:
            raise InvalidInput(f"fault {text!r}: the phase must be one of {', '.join(phases)}")
        if kind in _AT_STEP and not _STEP.fullmatch(where):
            raise InvalidInput(f"fault {text!r}: expected {kind}@step<k>, k >= 1")
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
    restore_level: RestoreLevelName = "prefix"
    # Asynchronous unless deterministic: a step's worth of groups generates ahead of training
    # and the sampler (windowed by default, one weight version of staleness) picks the ready.
    sampler: SamplerName | None = None
    deterministic: bool = False
    checkpoint_every: int = Field(default=2, ge=1, description="trainer checkpoint cadence")
    faults: tuple[Fault, ...] = tuple(Fault.parse(f) for f in DEFAULT_FAULTS)
    interval_s: float = Field(default=3.0, gt=0)
    engine: Literal["reference", "vllm"] = "reference"
    journal: bool = True  # a durable journal between snapshots (docs/journal.md)
    # NeMo Gym's environment, unmodified, through the gateway (rollsafe.reference.rl.gym_workplace)
    gym: GymEnvironment | None = None

    @model_validator(mode="before")
    @classmethod
    def _gym_faults_by_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("gym") is not None and "faults" not in data:
            return {**data, "faults": tuple(Fault.parse(f) for f in DEFAULT_GYM_FAULTS)}
        return data

    @field_validator("faults")
    @classmethod
    def _one_each(cls, faults: tuple[Fault, ...]) -> tuple[Fault, ...]:
        kinds = [f.kind for f in faults]
        if len(set(kinds)) != len(kinds):
            raise ValueError("at most one fault of each kind")
        steps = [f.where for f in faults if f.kind in _AT_STEP]
        if len(set(steps)) != len(steps):
            raise ValueError(f"at most one of {', '.join(_AT_STEP)} at each step")
        phases = {f.kind: f.where for f in faults if f.kind in ("coordinator", "temporal")}
        if len(phases) == 2 and len(set(phases.values())) == 1:
            raise ValueError("coordinator and temporal faults need different phases")
        return faults

    @model_validator(mode="after")
    def _deterministic_is_in_order(self) -> DemoOptions:
        if self.deterministic and self.sampler not in (None, "in_order"):
            raise ValueError(
                f"--deterministic trains in dataset order: it cannot use sampler {self.sampler}"
            )
        return self

    @model_validator(mode="after")
    def _crash_within_the_run(self) -> DemoOptions:
        for fault in self.faults:
            if fault.kind in _AT_STEP and int(fault.where[4:]) > self.steps:
                raise ValueError(f"{fault}: the run has only {self.steps} steps")
        return self

    @model_validator(mode="after")
    def _gym_takes_what_it_can(self) -> DemoOptions:
        if self.gym is None:
            return self
        if self.engine != "reference":
            raise ValueError("--gym serves a scripted policy: --engine does not apply")
        refused = [str(f) for f in self.faults if f.kind in _NOT_WITH_GYM]
        if refused:
            raise ValueError(
                f"--gym takes the faults coordinator, run, kill and temporal, not {refused}"
            )
        return self

    @property
    def script_path(self) -> Path | None:
        return self.out.resolve() / GYM_SCRIPT if self.gym is not None else None

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
            checkpoint_every=self.checkpoint_every,
            journal=self.journal,
            model=self._model(),
            workload="gym" if self.gym is not None else "workplace",
            **self._pacing(),
        )

    def _model(self) -> ModelConfig | HfModel:
        if self.gym is not None:
            return HfModel(path=self.out.resolve() / GYM_MODEL_DIR.format(seed=self.seed))
        if self.engine == "vllm":
            return HfModel(path=self.out.resolve() / MODEL_DIR.format(seed=self.seed))
        return ModelConfig()

    def _pacing(self) -> dict[str, object]:
        if self.deterministic:
            return {"sampler": "in_order", "staleness_window": 0, "ahead_steps": 0}
        return {"sampler": self.sampler or "windowed", "staleness_window": 1, "ahead_steps": 1}
