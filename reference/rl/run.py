"""The reference RL run, in one process (issue 7, first part): prompts handed out through the
controller, episodes dispatched through the admission gate to workplace environments, rows
sealed into the data plane, GRPO steps on the engine's policy, new weights pushed to the engine
server, a trainer checkpoint per step, and snapshots whose phases park, cut and commit the
environments. A run restored from a snapshot continues from it and rolls back the steps
committed after it, so the evidence files describe one lineage.

Deterministic mode (the only one here yet): step s trains groups ``[s * G, (s + 1) * G)``,
generated with the weights of step s (no lag), so two runs with the same seed train the same
tokens whatever crashes and restores happen in between: sampling noise is a function of
``(rollout, turn, position)``, a resumed call continues exactly, and the weights after each
step are a function of the rows trained.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from reference.rl.rollouts import row_from_result, samples_from_row, task_for, tokens_sha256
from reference.rl.trainer import PolicyTrainer, StepResult
from rollsafe.actor import ControllerService
from rollsafe.config import RunConfig
from rollsafe.controller import ROLLOUT_PARTITION
from rollsafe.engine.http import EngineClient
from rollsafe.engine.model import ModelConfig
from rollsafe.env.client import EnvClient
from rollsafe.env.fleet import EnvFleet
from rollsafe.env.protocol import RunEpisode
from rollsafe.evidence import (
    FAULTS,
    HANDED_OUT,
    MUTATIONS,
    REPORT,
    ROLLED_BACK,
    TRAINED,
    EnvMutation,
    FaultRecord,
    HandedOut,
    RunReport,
    TrainedRow,
    read_lines,
    write_report,
)
from rollsafe.ids import EpisodeId
from rollsafe.loop import LoopThread
from rollsafe.participants import ParticipantOptions, Participants, to_ref
from rollsafe.phases import (
    PHASES,
    PhaseRequest,
    PhaseResult,
    RestorePlan,
    RestoreRequest,
    SnapshotSpec,
)

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
    restore_level: str = "prefix"
    lr: float = Field(default=0.02, gt=0)
    model: ModelConfig = ModelConfig()


class Endpoints(BaseModel):
    """Where the run's servers listen (one engine, environment instances by name)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_url: str
    engine_token: str
    envs: dict[str, str]
    env_token: str


class ReferenceRun:
    def __init__(self, settings: RunSettings, endpoints: Endpoints, root: Path, out: Path):
        self.settings, self.root, self.out = settings, root, out
        out.mkdir(parents=True, exist_ok=True)
        self.loop = LoopThread()
        self.fleet, self.engine = self.loop.run(_clients(endpoints))
        self.instances = sorted(endpoints.envs)
        self.participants = Participants(
            self.fleet, {"engine": self.engine}, loop=self.loop, options=ParticipantOptions()
        )
        config = RunConfig(
            run_id=settings.run_id,
            group_size=settings.group_size,
            groups_per_step=settings.groups_per_step,
            sampler="in_order",
            staleness_window=0,
            restore_level=settings.restore_level,
        )
        self.service = ControllerService(
            config, root / SNAPSHOTS_DIR, keep_latest_k=8, participants=self.participants
        )
        self.trainer = PolicyTrainer(settings.model, settings.seed, lr=settings.lr)
        self.step = 0
        self.snapshots: list[PhaseResult] = []
        self._running: list[Future[None]] = []

    # ---- lifecycle -------------------------------------------------------------------------

    @classmethod
    def restored(
        cls, settings: RunSettings, endpoints: Endpoints, root: Path, out: Path
    ) -> tuple[ReferenceRun, RestorePlan]:
        """A run continued from its newest snapshot: the controller (and the environments'
        episodes) from the snapshot, the trainer from the checkpoint of the snapshot's weight
        version; steps committed after it are rolled back in the evidence."""
        run = cls(settings, endpoints, root, out)
        restore = RestoreRequest(run_id=settings.run_id, restore_id=f"r-{uuid.uuid4().hex[:8]}")
        plan = run.service.restore(restore)
        version = plan.weight_version
        run.trainer = PolicyTrainer.load(
            root / TRAINER_DIR / f"v{version:06d}", settings.model, lr=settings.lr
        )
        run.step = version  # step s commits weight version s + 1
        if version > 0:
            run.loop.run(run.engine.update_weights(run.trainer.weights(), version))
        _roll_back(out, first_undone_step=version)
        _set_aside_checkpoints(root / TRAINER_DIR, newer_than=version, tag=restore.restore_id)
        return run, plan

    def close(self) -> None:
        """Stop: episodes still running are cancelled (a crashed run's are lost anyway)."""
        for future in self._running:
            future.cancel()

        async def close_clients() -> None:
            await self.fleet.aclose()
            await self.engine.aclose()

        self.loop.run(close_clients())
        self.loop.close()

    # ---- the run ---------------------------------------------------------------------------

    def run(
        self, until_step: int | None = None, during: Callable[[int], None] | None = None
    ) -> list[StepResult]:
        """Train steps until ``until_step`` (default: all). ``during(step)`` is called once
        the step's episodes are under way (a test takes a snapshot or crashes there)."""
        last = self.settings.steps if until_step is None else until_step
        results: list[StepResult] = []
        while self.step < last:
            groups = self._groups(self.step)
            running = self._generate(groups)
            if during is not None:
                during(self.step)
            for future in running:
                future.result(timeout=300)
            results.append(self._train(groups))
        return results

    def snapshot(self) -> PhaseResult:
        seq = self.service.next_seq()
        spec = SnapshotSpec(run_id=self.settings.run_id, seq=seq, anchor_step=self.step)
        results = [self.service.run_phase(PhaseRequest(spec=spec, phase=p)) for p in PHASES]
        self.snapshots.append(results[-1])
        return results[-1]

    def record_fault(self, fault: FaultRecord) -> None:
        _append(self.out / FAULTS, [fault])

    def finish(self) -> RunReport:
        """Write handed_out.jsonl and report.json from the controller's final state."""
        (self.out / FAULTS).touch()  # a run without faults says so with an empty file
        trained = {row.group_idx for row in read_lines(self.out / TRAINED, TrainedRow)}
        position = self.service.controller.loader_position
        lines = [
            HandedOut(
                group_idx=idx,
                group_id=f"{self.settings.run_id}-{idx}",
                status="trained" if idx in trained else "owed",
            )
            for idx in range(position)
        ]
        _write_lines(self.out / HANDED_OUT, lines)
        report = RunReport(
            run_id=self.settings.run_id,
            seed=self.settings.seed,
            steps=self.step,
            group_size=self.settings.group_size,
            groups_per_step=self.settings.groups_per_step,
            sampler="in_order",
            restore_level=self.settings.restore_level,
            deterministic=True,
            totals={"snapshots": float(len(self.snapshots))},
        )
        write_report(self.out / REPORT, report)
        return report

    # ---- generation ------------------------------------------------------------------------

    def _groups(self, step: int) -> list[int]:
        size = self.settings.groups_per_step
        groups = list(range(step * size, (step + 1) * size))
        position = self.service.controller.loader_position
        fresh = [idx for idx in groups if idx >= position]
        if fresh:
            self.service.handout(fresh)
        return groups

    def _generate(self, groups: Sequence[int]) -> list[Future[None]]:
        ledger = self.service.controller.ledger
        self._running = [
            asyncio.run_coroutine_threadsafe(self._episode(idx, i), self.loop.loop)
            for idx in groups
            for i in ledger.unsealed(idx)
        ]
        return self._running

    def _instance(self, idx: int, i: int) -> str:
        return self.instances[(idx * self.settings.group_size + i) % len(self.instances)]

    async def _episode(self, idx: int, i: int) -> None:
        """Dispatch through the gate (waiting while a snapshot holds it closed), run, seal;
        the reply is marked done after the seal, so a drain never loses it."""
        owner = self.service.controller.ledger.owner(idx, i) or self._instance(idx, i)
        while (episode := await asyncio.to_thread(self.service.dispatch, idx, i, owner)) is None:
            await asyncio.sleep(0.02)
        await self._run_episode(idx, i, episode, owner)

    async def _run_episode(self, idx: int, i: int, episode: EpisodeId, owner: str) -> None:
        ref = to_ref(episode)
        task = task_for(idx, self.settings.turns)
        self.participants.pending.add(ref, owner)
        try:
            run = RunEpisode(episode=ref, task=task.model_dump())
            result = await self.fleet.run_episode(owner, run, max_wait_s=120)
            row = row_from_result(result, task)
            mutations = [
                {
                    "instance": owner,
                    "rollout_id": ref.rollout_id,
                    "turn": m["turn"],
                    "call_id": m["call_id"],
                }
                for m in result.info["mutations"]
            ]
            row["mutations"] = np.frombuffer(json.dumps(mutations).encode(), np.uint8)
            await asyncio.to_thread(self.service.seal, idx, i, episode.attempt, row)
        finally:
            self.participants.pending.done(ref)

    # ---- training --------------------------------------------------------------------------

    def _train(self, groups: Sequence[int]) -> StepResult:
        controller = self.service.controller
        self.service.claim(groups, self.step)
        keyed = {
            idx: [(controller.row_key(idx, i), i) for i in range(self.settings.group_size)]
            for idx in groups
        }
        keys = [key for pairs in keyed.values() for key, _ in pairs]
        rows = controller.dataplane.get(ROLLOUT_PARTITION, keys)
        batch = [
            [s for key, _ in keyed[idx] for s in samples_from_row(key, rows[key])] for idx in groups
        ]
        result = self.trainer.train_step(batch)
        self.loop.run(self.engine.update_weights(self.trainer.weights(), result.weight_version))
        self.trainer.save(self.root / TRAINER_DIR / f"v{result.weight_version:06d}")
        trained = [
            TrainedRow(
                step=self.step,
                group_idx=idx,
                rollout_id=key,
                attempt=controller.ledger.attempt(idx, i),
                n_tokens=int(rows[key]["tokens"].size),
                tokens_sha256=tokens_sha256(rows[key]),
                restored_prefix_tokens=int(rows[key]["restored_prefix_tokens"]),
            )
            for idx in groups
            for key, i in keyed[idx]
        ]
        mutations = [
            EnvMutation.model_validate(m)
            for key in keys
            for m in json.loads(bytes(rows[key]["mutations"]))
        ]
        self.service.commit_step(groups)
        _append(self.out / TRAINED, trained)
        _append(self.out / MUTATIONS, mutations)
        self.step += 1
        return result


async def _clients(endpoints: Endpoints) -> tuple[EnvFleet, EngineClient]:
    clients = {name: EnvClient(url, endpoints.env_token) for name, url in endpoints.envs.items()}
    return EnvFleet(clients), EngineClient(endpoints.engine_url, endpoints.engine_token)


def _append(path: Path, lines: Sequence[BaseModel]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.writelines(line.model_dump_json() + "\n" for line in lines)
        handle.flush()


def _write_lines(path: Path, lines: Sequence[BaseModel]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text("".join(line.model_dump_json() + "\n" for line in lines))
    temporary.replace(path)


def _roll_back(out: Path, first_undone_step: int) -> None:
    """Rows of steps the restore undid move to rolled_back_rows.jsonl; their rollouts'
    mutations leave env_mutations.jsonl (the rollouts are trained again in this lineage)."""
    if not (out / TRAINED).exists():
        return
    rows = read_lines(out / TRAINED, TrainedRow)
    undone = [row for row in rows if row.step >= first_undone_step]
    if not undone:
        return
    gone = {row.rollout_id for row in undone}
    _write_lines(out / TRAINED, [row for row in rows if row.step < first_undone_step])
    _append(out / ROLLED_BACK, undone)
    if (out / MUTATIONS).exists():
        kept = [m for m in read_lines(out / MUTATIONS, EnvMutation) if m.rollout_id not in gone]
        _write_lines(out / MUTATIONS, kept)


def _set_aside_checkpoints(directory: Path, newer_than: int, tag: str) -> None:
    """Trainer checkpoints of the undone steps move to ``rolled-back/<restore>/``: kept for a
    post-mortem, out of the way of the steps this lineage commits under the same versions."""
    for checkpoint in sorted(directory.glob("v*")):
        if int(checkpoint.name[1:]) > newer_than:
            aside = directory / "rolled-back" / tag
            aside.mkdir(parents=True, exist_ok=True)
            checkpoint.rename(aside / checkpoint.name)
