"""The reference RL run: prompts handed out through the controller, episodes dispatched through
the admission gate to environments (the workload's: :mod:`rollsafe.reference.rl.workloads`),
rows sealed into the data plane, GRPO steps on the engine's policy, new weights pushed to the
engine server, a trainer checkpoint every ``checkpoint_every`` steps, and snapshots whose
phases park, cut and commit the environments. A run restored from a snapshot continues from
it and rolls back the steps committed after it, so the evidence files describe one lineage.

Asynchronous by default: ``ahead_steps`` steps' worth of groups generate while the trainer
trains, the engine takes new weights between two tokens of the calls in flight, and the
sampler picks each step's groups among those ready (``windowed``: within
``staleness_window`` weight versions; a ready group past it is evicted).

Deterministic mode (``in_order`` sampler, nothing ahead): step s trains groups
``[s * G, (s + 1) * G)``, generated with the weights of step s (no lag), so two runs with the
same seed train the same tokens whatever crashes and restores happen in between: sampling
noise is a function of ``(rollout, turn, position)``, a resumed call continues exactly, and
the weights after each step are a function of the rows trained.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from rollsafe.core.config import RestoreLevelName, RunConfig, SamplerName
from rollsafe.core.phases import (
    PHASES,
    Phase,
    PhaseRequest,
    PhaseResult,
    RestorePlan,
    RestoreRequest,
    SnapshotSpec,
)
from rollsafe.engine.http import EngineClient
from rollsafe.engine.model import ModelConfig
from rollsafe.evidence.files import (
    FAULTS,
    GENERATIONS,
    MUTATIONS,
    REPORT,
    TRAINED,
    FaultRecord,
    RunReport,
    append_lines,
    write_report,
)
from rollsafe.evidence.lineage import EVICTED, Evicted, roll_back, undo_evictions
from rollsafe.evidence.recorder import trained_row, write_handed_out
from rollsafe.loop_thread import LoopThread
from rollsafe.reference.rl.controller import Endpoints, ReferenceController
from rollsafe.reference.rl.lineage import (
    checkpoint_dir,
    checkpoint_versions,
    set_aside_checkpoints,
)
from rollsafe.reference.rl.policy import PolicyModel
from rollsafe.reference.rl.trainer import PolicyTrainer, StepResult
from rollsafe.reference.rl.workloads import WorkloadName, make_workload, mutations_of_row

TRAINER_DIR = "trainer"
SNAPSHOTS_DIR = "snapshots"


class RunSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = "demo"
    seed: int = 0
    steps: int = Field(default=4, ge=1)
    group_size: int = Field(default=2, ge=1)
    groups_per_step: int = Field(default=2, ge=1)
    turns: int = Field(default=4, ge=1, le=16)
    workload: WorkloadName = "workplace"
    restore_level: RestoreLevelName = "prefix"
    sampler: SamplerName = "in_order"
    staleness_window: int = Field(default=0, ge=0, description="windowed: weight versions")
    ahead_steps: int = Field(default=0, ge=0, description="steps' groups generating ahead")
    lr: float = Field(default=0.02, gt=0)
    episode_timeout_s: float = Field(default=120.0, gt=0, description="a step's episodes")
    checkpoint_every: int = Field(default=1, ge=1, description="steps between checkpoints")
    journal: bool = Field(default=True, description="a durable journal between snapshots")
    model: PolicyModel = Field(default_factory=ModelConfig, discriminator="kind")

    @property
    def deterministic(self) -> bool:
        return self.sampler == "in_order" and self.ahead_steps == 0


class ControllerCalls(Protocol):
    """What the run asks of its controller: a :class:`ReferenceController` here, or the run's Ray
    actor through a proxy (the same methods, each a remote call)."""

    def handout(self, groups: Sequence[int]) -> None: ...
    def generate(self, groups: Sequence[int] | None = None) -> int: ...
    def owned(self) -> int: ...
    def next_groups(self, timeout_s: float) -> tuple[list[int], list[int]]: ...
    def evict(self, groups: Sequence[int]) -> None: ...
    def claim(self, groups: Sequence[int], step: int) -> None: ...
    def rows(self, groups: Sequence[int]) -> Mapping[int, Sequence[Any]]: ...
    def rollouts(self, groups: Sequence[int]) -> list[tuple[int, int, str, int]]: ...
    def commit_step(self, groups: Sequence[int]) -> None: ...
    def loader_position(self) -> int: ...
    def close(self) -> None: ...


class StepListener(Protocol):
    """Told of each committed step and each trainer checkpoint: the checkpoint workflows,
    through the SDK (:class:`rollsafe.client.Checkpointer`), in the demo."""

    def step_committed(self, step: int) -> None: ...
    def checkpoint_saved(self, weight_version: int, path: Path) -> None: ...


class _Nobody:
    def step_committed(self, step: int) -> None:
        pass

    def checkpoint_saved(self, weight_version: int, path: Path) -> None:
        pass


def run_config(settings: RunSettings) -> RunConfig:
    return RunConfig(
        run_id=settings.run_id,
        group_size=settings.group_size,
        groups_per_step=settings.groups_per_step,
        sampler=settings.sampler,
        staleness_window=settings.staleness_window,
        restore_level=settings.restore_level,
        journal=settings.journal,
    )


class ReferenceRun:
    """The trainer side of the run, and the evidence it leaves in ``out``. The controller is
    made here (in process) unless one is given (the run's actor, through a proxy)."""

    def __init__(
        self,
        settings: RunSettings,
        endpoints: Endpoints,
        root: Path,
        out: Path,
        controller: ControllerCalls | None = None,
    ) -> None:
        self.settings, self.root, self.out = settings, root, out
        out.mkdir(parents=True, exist_ok=True)
        self.local = (
            ReferenceController(
                run_config(settings),
                root / SNAPSHOTS_DIR,
                endpoints,
                settings.turns,
                generations=str(out / GENERATIONS),
                workload=settings.workload,
            )
            if controller is None
            else None
        )
        chosen = self.local if self.local is not None else controller
        assert chosen is not None
        self.controller: ControllerCalls = chosen
        self.workload = make_workload(settings.workload, settings.turns)
        # The trainer's own connection to the engine, for pushing weights.
        self.loop = LoopThread("rollsafe-trainer")
        self.engine = EngineClient(endpoints.engine_url, endpoints.engine_token)
        self.trainer = PolicyTrainer(settings.model, settings.seed, lr=settings.lr)
        self.step = 0
        self.snapshots: list[PhaseResult] = []
        self.listener: StepListener = _Nobody()

    # ---- lifecycle -------------------------------------------------------------------------

    def resume_from(self, plan: RestorePlan, restore_id: str) -> None:
        """After the controller restored ``plan``: the trainer from the checkpoint of the
        snapshot's weight version, the engine given those weights, and the evidence of the
        steps committed after the snapshot rolled back."""
        version = plan.weight_version
        self.trainer = PolicyTrainer.load(
            checkpoint_dir(self.root / TRAINER_DIR, version),
            self.settings.model,
            lr=self.settings.lr,
        )
        self.step = version  # step s commits weight version s + 1
        if version > 0:
            self.loop.run(self.engine.update_weights(self.trainer.weights(), version))
        roll_back(self.out, first_undone_step=version)
        undo_evictions(self.root / EVICTED, plan)
        set_aside_checkpoints(self.root / TRAINER_DIR, newer_than=version, tag=restore_id)

    def anchor_now(self) -> None:
        """A trainer checkpoint of the current weight version unless there is one: a snapshot
        taken now can then be restored (with ``checkpoint_every`` > 1 it might not)."""
        path = checkpoint_dir(self.root / TRAINER_DIR, self.step)
        if not path.exists():
            self.trainer.save(path)

    def anchors(self) -> list[int]:
        """Weight versions a restore may start from: those with a trainer checkpoint."""
        return checkpoint_versions(self.root / TRAINER_DIR)

    @classmethod
    def restored(
        cls, settings: RunSettings, endpoints: Endpoints, root: Path, out: Path
    ) -> tuple[ReferenceRun, RestorePlan]:
        """A run continued from its newest snapshot, in process."""
        run = cls(settings, endpoints, root, out)
        assert run.local is not None
        restore_id = f"r-{uuid.uuid4().hex[:8]}"
        request = RestoreRequest(
            run_id=settings.run_id, restore_id=restore_id, weight_versions=tuple(run.anchors())
        )
        plan = run.local.restore(request)
        run.resume_from(plan, restore_id)
        return run, plan

    def close(self) -> None:
        self.controller.close()
        self.abandon()

    def abandon(self) -> None:
        """Drop the trainer's own connections only (the controller went down with a crash)."""
        self.loop.run(self.engine.aclose())
        self.loop.close()

    # ---- the run ---------------------------------------------------------------------------

    def run(
        self, until_step: int | None = None, during: Callable[[int], None] | None = None
    ) -> list[StepResult]:
        """Train steps until ``until_step`` (default: all). ``during(step)`` is called once
        the step's episodes are under way (a test takes a snapshot or crashes there)."""
        last = self.settings.steps if until_step is None else until_step
        results: list[StepResult] = []
        initial = checkpoint_dir(self.root / TRAINER_DIR, 0)
        if self.step == 0 and not initial.exists():  # anchors a snapshot before any step
            self.trainer.save(initial)
        while self.step < last:
            self._top_up()
            if during is not None:
                during(self.step)
            results.append(self._train(self._next_groups()))
        return results

    def snapshot(self) -> dict[Phase, PhaseResult]:
        """The ten phases, in process (the demo has Temporal workflows run them)."""
        assert self.local is not None
        spec = SnapshotSpec(
            run_id=self.settings.run_id, seq=self.local.next_seq(), anchor_step=self.step
        )
        results = {p: self.local.run_phase(PhaseRequest(spec=spec, phase=p)) for p in PHASES}
        self.snapshots.append(results[Phase.PUBLISH])
        return results

    def record_fault(self, fault: FaultRecord) -> None:
        append_lines(self.out / FAULTS, [fault])

    def finish(self, totals: dict[str, float] | None = None) -> RunReport:
        """Write handed_out.jsonl and report.json from the controller's final state."""
        (self.out / FAULTS).touch()  # a run without faults says so with an empty file
        position = self.controller.loader_position()
        write_handed_out(self.out, self.settings.run_id, position, self.root / EVICTED)
        report = RunReport(
            run_id=self.settings.run_id,
            seed=self.settings.seed,
            steps=self.step,
            group_size=self.settings.group_size,
            groups_per_step=self.settings.groups_per_step,
            sampler=self.settings.sampler,
            restore_level=self.settings.restore_level,
            deterministic=self.settings.deterministic,
            totals=totals if totals is not None else {"snapshots": float(len(self.snapshots))},
            journal=self.settings.journal,
        )
        write_report(self.out / REPORT, report)
        return report

    # ---- steps -----------------------------------------------------------------------------

    def _next_groups(self) -> list[int]:
        """The step's groups; stale ones found meanwhile are recorded, then evicted."""
        while True:
            groups, stale = self.controller.next_groups(self.settings.episode_timeout_s)
            if not stale:
                return groups
            evictions = [Evicted(step=self.step, group_idx=idx) for idx in stale]
            append_lines(self.root / EVICTED, evictions)
            self.controller.evict(stale)

    def _top_up(self) -> None:
        """Hand out groups until ``1 + ahead_steps`` steps' worth are owned, and start every
        owned rollout not generating yet (in deterministic mode: exactly this step's)."""
        size = self.settings.groups_per_step
        wanted = size * (1 + self.settings.ahead_steps) - self.controller.owned()
        if wanted > 0:
            position = self.controller.loader_position()
            self.controller.handout(list(range(position, position + wanted)))
        if self.settings.deterministic:
            # Only this step's groups, with this step's weights: a restore whose journal
            # rolled a commit back also owns the next step's groups (handed out after that
            # commit); generated now, they would use the weights before the step is retrained.
            first = self.step * size
            self.controller.generate(list(range(first, first + size)))
        else:
            self.controller.generate()

    def _train(self, groups: Sequence[int]) -> StepResult:
        self.controller.claim(groups, self.step)
        rollouts = self.controller.rollouts(groups)
        by_group = self.controller.rows(groups)
        rows = {key: by_group[idx][i] for idx, i, key, _ in rollouts}
        samples = {key: self.workload.samples(key, rows[key]) for _, _, key, _ in rollouts}
        batch = [
            [s for idx, _, key, _ in rollouts if idx == g for s in samples[key]] for g in groups
        ]
        result = self.trainer.train_step(batch)
        self.loop.run(self.engine.update_weights(self.trainer.weights(), result.weight_version))
        saved = None
        if result.weight_version % self.settings.checkpoint_every == 0:
            saved = checkpoint_dir(self.root / TRAINER_DIR, result.weight_version)
            self.trainer.save(saved)
        trained = [trained_row(self.step, i, key, n, rows[key]) for i, _, key, n in rollouts]
        mutations = [m for _, _, key, _ in rollouts for m in mutations_of_row(rows[key])]
        self.controller.commit_step(groups)
        append_lines(self.out / TRAINED, trained)
        append_lines(self.out / MUTATIONS, mutations)
        self.listener.step_committed(self.step)
        if saved is not None:
            self.listener.checkpoint_saved(result.weight_version, saved)
        self.step += 1
        return result
