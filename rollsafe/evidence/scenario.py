"""Scenario files: a run written down as events, replayed against the real RunState.

The format is exact (external suites are written against it; see docs/scenarios.md). A
checkpoint really writes a snapshot to disk, a crash really drops every in-memory object (the
data plane included) and a restore really reads the newest valid snapshot into new objects.
Row content is a pure function of (group, rollout, attempt), so the runner checks every
restored row byte for byte against what was committed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from rollsafe.checkpoint.controller import Controller
from rollsafe.checkpoint.phases import take_snapshot
from rollsafe.core.config import RestoreLevelName, RunConfig, SamplerName
from rollsafe.core.phases import SnapshotSpec
from rollsafe.core.run_state import ROLLOUT_PARTITION, RunState
from rollsafe.core.states import AttemptState, GroupState
from rollsafe.dataplane import DataPlane
from rollsafe.errors import RollsafeError, RowMismatch, ScenarioError
from rollsafe.journal.run import RunJournal, restore_target
from rollsafe.snapshot import SnapshotStore, state_files

SCENARIO_RUN_ID = "scenario"
Index = Annotated[StrictInt, Field(ge=0)]


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Handout(_Event):
    op: Literal["handout"]
    groups: list[Index] = Field(min_length=1)


class Commit(_Event):
    op: Literal["commit"]
    group: Index
    rollouts: list[Index] = Field(min_length=1)


class Claim(_Event):
    op: Literal["claim"]
    groups: list[Index] = Field(min_length=1)


class Train(_Event):
    op: Literal["train"]
    groups: list[Index] = Field(min_length=1)


class Evict(_Event):
    op: Literal["evict"]
    group: Index


class WeightVersion(_Event):
    op: Literal["weight_version"]
    version: Index


class Checkpoint(_Event):
    op: Literal["checkpoint"]


class Crash(_Event):
    op: Literal["crash"]


class Restore(_Event):
    op: Literal["restore"]
    # The weights the trainer restored: steps trained after them are rolled back (their
    # groups ready again). None: every step the snapshot (and journal) holds stands.
    weight_version: Index | None = None


Event = Annotated[
    Handout | Commit | Claim | Train | Evict | WeightVersion | Checkpoint | Crash | Restore,
    Field(discriminator="op"),
]


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    sampler: SamplerName
    group_size: Annotated[StrictInt, Field(ge=1, le=1024)]
    groups_per_step: Annotated[StrictInt, Field(ge=1)]
    staleness_window: Annotated[StrictInt, Field(ge=0)] = 1
    # Extension to the published format: the restore level every group is handed out with.
    restore_level: RestoreLevelName = "sibling"
    # Extension: the run keeps a journal between checkpoints, so a crash after seals and
    # without a new checkpoint loses none of them (docs/journal.md). Default: snapshots only.
    journal: bool = False
    events: list[Event]

    def run_config(self) -> RunConfig:
        return RunConfig(
            run_id=SCENARIO_RUN_ID,
            group_size=self.group_size,
            groups_per_step=self.groups_per_step,
            sampler=self.sampler,
            staleness_window=self.staleness_window,
            restore_level=self.restore_level,
            journal=self.journal,
        )


class GroupReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state: Literal["ready", "generating"]
    restored_rollouts: list[int]  # sealed: rows committed (after a restore: came back)
    regenerate: list[int]  # not sealed: still to generate


class ScenarioReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    loader_position: int
    weight_version: int
    groups: dict[str, GroupReport]
    next_selection: list[int]


def load_scenario(path: Path) -> Scenario:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ScenarioError(f"{path}: not valid JSON ({exc})") from None
    try:
        return Scenario.model_validate(raw)
    except ValidationError as exc:
        raise ScenarioError(f"{path}: {_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors()[:5]:
        where = ".".join(str(part) for part in error["loc"]) or "(top level)"
        problems.append(f"{where}: {error['msg']}")
    return "; ".join(problems)


def row_content(group: int, rollout: int, attempt: int) -> dict[str, np.ndarray]:
    """The row a rollout's attempt commits: a pure function of its identity."""
    seed = hashlib.sha256(f"{SCENARIO_RUN_ID}/{group}/{rollout}/{attempt}".encode()).digest()
    tokens = np.frombuffer(seed, dtype=np.uint16).astype(np.int32)
    return {
        "tokens": tokens,
        "logprobs": -(tokens.astype(np.float32) / 65536.0),
        "reward": np.array(float(seed[0]) / 255.0, dtype=np.float32),
    }


def commit_rollout(run: RunState, idx: int, i: int, owner: str | None = None) -> None:
    """Seal rollout ``i`` of group ``idx`` with its :func:`row_content`, dispatching its attempt
    first (to ``owner``) if it was only reserved: a scenario's ``commit`` event."""
    if run.ledger.state(idx, i) == AttemptState.RESERVED:
        run.dispatch(idx, i, owner)
    attempt = run.ledger.attempt(idx, i)
    run.seal(idx, i, attempt, row_content(idx, i, attempt))


def busy_run(run_id: str, dataplane: DataPlane) -> RunState:
    """A small run with work in flight, for examples and tests: group 0 ready (both rollouts
    sealed), group 1 half sealed, group 2 only handed out."""
    run = RunState(RunConfig(run_id=run_id, group_size=2, groups_per_step=2), dataplane)
    run.handout([0, 1, 2])
    for idx, siblings in ((0, (0, 1)), (1, (0,))):
        for i in siblings:
            run.dispatch(idx, i)
            run.seal(idx, i, 0, row_content(idx, i, 0))
    return run


class ScenarioRunner:
    def __init__(
        self, scenario: Scenario, snapshot_dir: Path, make_dataplane: Callable[[], DataPlane]
    ) -> None:
        self.scenario = scenario
        self.config = scenario.run_config()
        # Snapshots already in the directory are the run's history: a scenario may start
        # with "restore" to continue a run an earlier process checkpointed (a real crash).
        self.store = SnapshotStore(snapshot_dir, SCENARIO_RUN_ID)
        self.make_dataplane = make_dataplane
        self.state: RunState | None = RunState(self.config, make_dataplane())
        # Opened by the first event that changes the run (it starts, appending after what the
        # folder holds) or by a restore: a scenario that restores first writes nothing before
        # its restore succeeded (a start-over record would make the journal unrestorable).
        self.journal: RunJournal | None = None
        self._controller: Controller | None = None  # over the live state, for checkpoints
        self.crashed_at: int | None = None

    def run(self) -> ScenarioReport:
        for number, event in enumerate(self.scenario.events, start=1):
            try:
                self._apply(number, event)
            except RowMismatch:
                raise
            except RollsafeError as exc:
                if isinstance(exc, ScenarioError):
                    raise
                raise ScenarioError(f"event {number} ({event.op}): {exc}") from exc
        return self.report()

    def _live(self, number: int, event: _Event) -> RunState:
        if self.state is None:
            raise ScenarioError(
                f"event {number} ({getattr(event, 'op', '?')}): the run crashed at event "
                f"{self.crashed_at}; only 'restore' can follow"
            )
        return self.state

    def _journal(self) -> RunJournal:
        # No background flush: each event is made durable before the next (acknowledged).
        return RunJournal.for_store(self.store, flush_ms=None)

    def _apply(self, number: int, event: _Event) -> None:
        if isinstance(event, Crash):
            self._live(number, event)
            self.state, self.crashed_at = None, number  # every in-memory object is gone
            if self.journal is not None:
                self.journal.close()
                self.journal = None
        elif isinstance(event, Restore):
            self._restore(event.weight_version)
        else:
            run = self._live(number, event)
            if self.scenario.journal and self.journal is None:
                self.journal = self._journal()
                self.journal.start(run)
            self._apply_live(run, event)
            if self.journal is not None:
                self.journal.wait_durable(self.journal.last_id)

    def _apply_live(self, run: RunState, event: _Event) -> None:
        if isinstance(event, Handout):
            run.handout(event.groups)
        elif isinstance(event, Commit):
            self._commit(run, event)
        elif isinstance(event, Claim):
            run.claim(event.groups, step=run.weight_version)
        elif isinstance(event, Train):
            run.commit_step(event.groups)
        elif isinstance(event, Evict):
            run.evict(event.group)
        elif isinstance(event, WeightVersion):
            run.set_weight_version(event.version)
        elif isinstance(event, Checkpoint):
            self._checkpoint(run)

    def _checkpoint(self, run: RunState) -> None:
        """A snapshot through the controller's ten phases, as a worker runs them (capture in
        the park window, the write after resume, the run's deletions held meanwhile); the
        journal stays the runner's (it makes each event durable itself)."""
        controller = self._controller
        if controller is None or controller.state is not run:  # a restore made a new state
            controller = self._controller = Controller.from_parts(run, self.store, start_over=True)
        take_snapshot(controller, SnapshotSpec(run_id=SCENARIO_RUN_ID, seq=controller.next_seq()))
        if self.journal is not None:
            self.journal.compact(self.store)

    def _commit(self, run: RunState, event: Commit) -> None:
        for i in event.rollouts:
            commit_rollout(run, event.group, i)

    def _restore(self, weight_version: int | None) -> None:
        self.state = None  # a restore always starts from nothing but the disk
        if self.journal is not None:
            self.journal.close()
        self.journal = self._journal() if self.scenario.journal else None
        held = None if weight_version is None else (weight_version,)
        accept, replayer = restore_target(self.journal, held)
        state, _plan = state_files.restore(
            self.config, self.store, self.make_dataplane(), accept=accept, journal=replayer
        )
        if self.journal is not None:
            self.journal.resume()
        self._check_rows(state)
        self.state, self.crashed_at = state, None

    def _check_rows(self, run: RunState) -> None:
        for idx in run.ledger.groups():
            sealed = run.ledger.sealed(idx)
            rows = run.dataplane.get(ROLLOUT_PARTITION, [run.row_key(idx, i) for i in sealed])
            for i in sealed:
                key = run.row_key(idx, i)
                expected = row_content(idx, i, run.ledger.attempt(idx, i))
                if not same_row(rows[key], expected):
                    raise RowMismatch(idx, i, key, "restored row differs from the committed row")

    def report(self) -> ScenarioReport:
        run = self.state or RunState(self.config, self.make_dataplane())
        groups = {
            str(idx): GroupReport(
                state="ready" if state in (GroupState.READY, GroupState.CLAIMED) else "generating",
                restored_rollouts=run.ledger.sealed(idx),
                regenerate=run.ledger.unsealed(idx),
            )
            for idx, state, _ in run.index.rows()
        }
        return ScenarioReport(
            loader_position=run.loader_position,
            weight_version=run.weight_version,
            groups=groups,
            next_selection=run.select(),
        )


def same_row(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> bool:
    return set(actual) == set(expected) and all(
        actual[name].dtype == expected[name].dtype
        and actual[name].shape == expected[name].shape
        and actual[name].tobytes() == expected[name].tobytes()
        for name in expected
    )
