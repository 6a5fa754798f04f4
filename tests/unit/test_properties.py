"""Property tests: random runs with checkpoints, crashes and restores keep invariants 1-3.

A hypothesis state machine drives the real :class:`RunState` (snapshots really written to
disk, a crash drops every in-memory object, a restore reads the newest snapshot that verifies
into a fresh data plane) and keeps its own reference model of the run in plain Python. Every
expectation comes from that model, never from the controller's own state:

1. Owed back: after a restore the controller owns exactly the groups handed out below the
   snapshot's loader position that were neither trained nor evicted by then, with the
   snapshot's loader position and weight version.
2. Sealed stays sealed: a rollout sealed at snapshot time comes back SEALED with the same
   attempt and byte-identical row, and is never listed to regenerate; the unsealed ones are
   exactly those listed (with the ledger's restart rules: a dispatched attempt comes back as
   attempt + 1, and at prompt_group level a partial group is discarded whole).
3. Trained once: in the lineage that survives (steps committed after the restored snapshot
   never happened), no group is trained by two steps, and groups claimed by a step that never
   committed come back READY.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from rollsafe.core.config import RunConfig
from rollsafe.core.ids import snapshot_dir_name
from rollsafe.core.phases import RestorePlan
from rollsafe.core.run_state import RunState
from rollsafe.core.states import AttemptState, GroupState
from rollsafe.dataplane import DataPlane
from rollsafe.errors import SealConflict, UnknownGroup
from rollsafe.evidence.scenario import row_content, same_row
from rollsafe.snapshot import SnapshotStore, state_files

RUN_ID = "props"
PARTITION = "rollouts"
SAMPLERS = ["windowed", "in_order", "weight_fifo"]
LEVELS = ["sibling", "prompt_group"]
MAX_OWNED = 6
KEEP_LATEST = 2  # SnapshotStore's default retention, modelled below

# 6 combinations x 50 examples x 40 steps keeps the file well under a minute on 2 cores. On
# TransferQueue every put and read is a round trip (~3 ms): fewer, shorter runs of the same
# machine show the backend keeps the invariants without repeating the search's breadth.
SETTINGS = {
    "memory": settings(max_examples=50, stateful_step_count=40, deadline=None),
    "transferqueue": settings(max_examples=20, stateful_step_count=30, deadline=None),
}

RESERVED, DISPATCHED, SEALED = "reserved", "dispatched", "sealed"
_ATTEMPT_STATES = {
    RESERVED: AttemptState.RESERVED,
    DISPATCHED: AttemptState.DISPATCHED,
    SEALED: AttemptState.SEALED,
}


def row_key(idx: int, i: int) -> str:
    # docs/design.md section 2: rollout_id = f"{group_id}_g{i}", group_id = f"{run_id}-{idx}".
    return f"{RUN_ID}-{idx}_g{i}"


# ---- the reference model ------------------------------------------------------------------


@dataclass
class ModelRollout:
    state: str = RESERVED
    attempt: int = 0


@dataclass
class ModelGroup:
    level: str
    start_version: int
    rollouts: list[ModelRollout]
    started: bool = False  # some sibling was dispatched (the index says GENERATING)
    claimed: bool = False

    @property
    def all_sealed(self) -> bool:
        return all(r.state == SEALED for r in self.rollouts)

    @property
    def state(self) -> GroupState:
        if self.claimed:
            return GroupState.CLAIMED
        if self.all_sealed:
            return GroupState.READY
        return GroupState.GENERATING if self.started else GroupState.RESERVED

    def siblings_in(self, *states: str) -> list[int]:
        return [i for i, r in enumerate(self.rollouts) if r.state in states]


@dataclass
class RunModel:
    loader_position: int = 0
    weight_version: int = 0
    handed_out: set[int] = field(default_factory=set)
    evicted: set[int] = field(default_factory=set)
    # The surviving lineage: one entry per committed step, the groups it trained.
    trained_steps: list[list[int]] = field(default_factory=list)
    groups: dict[int, ModelGroup] = field(default_factory=dict)

    def trained(self) -> list[int]:
        return [idx for step in self.trained_steps for idx in step]

    def owed(self) -> set[int]:
        """Invariant 1, literally: handed out below the loader, not trained, not evicted."""
        below = {idx for idx in self.handed_out if idx < self.loader_position}
        return below - set(self.trained()) - self.evicted

    def in_states(self, *states: GroupState) -> list[int]:
        return sorted(idx for idx, g in self.groups.items() if g.state in states)

    def sealed_keys(self) -> set[str]:
        return {row_key(idx, i) for idx, g in self.groups.items() for i in g.siblings_in(SEALED)}


@dataclass
class ModelSnapshot:
    name: str
    checkpoint_id: str
    model: RunModel
    corrupted: bool = False


@dataclass
class ExpectedRestore:
    model: RunModel
    released: list[int]
    partial: dict[int, tuple[list[int], list[int]]]  # idx -> (restored, regenerate)
    dropped_keys: set[str]  # rows of sealed siblings discarded (prompt_group)
    redispatch: list[int]


def expected_restore(at_snapshot: RunModel) -> ExpectedRestore:
    """The ledger's restart rules (docs/design.md sections 2 and 6), written from the design."""
    model = copy.deepcopy(at_snapshot)
    released = model.in_states(GroupState.CLAIMED)
    for idx in released:
        model.groups[idx].claimed = False  # that step never committed: the claim is void
    partial: dict[int, tuple[list[int], list[int]]] = {}
    dropped: set[str] = set()
    for idx, group in sorted(model.groups.items()):
        if group.all_sealed:
            continue
        whole_group = group.level == "prompt_group"
        restored, regenerate = [], []
        for i, rollout in enumerate(group.rollouts):
            if rollout.state == SEALED and not whole_group:
                restored.append(i)
                continue
            if rollout.state == SEALED:
                dropped.add(row_key(idx, i))
            if rollout.state in (SEALED, DISPATCHED):
                # The attempt that was out there is abandoned; regenerating mints a new one.
                rollout.attempt += 1
            rollout.state = RESERVED
            regenerate.append(i)
        partial[idx] = (restored, regenerate)
    # Admitted (generating) groups are redispatched before groups never dispatched.
    redispatch = sorted(partial, key=lambda idx: (not model.groups[idx].started, idx))
    return ExpectedRestore(model, released, partial, dropped, redispatch)


def expected_selection(model: RunModel, config: RunConfig) -> list[int]:
    """The three samplers of rollsafe.core.buffer.samplers, from their documented rules."""
    count = config.groups_per_step
    rows = sorted(model.groups.items())
    if config.sampler == "windowed":
        eligible = [
            idx
            for idx, g in rows
            if g.state == GroupState.READY
            and model.weight_version - g.start_version <= config.staleness_window
        ]
        return eligible[:count] if len(eligible) >= count else []
    if config.sampler == "weight_fifo":
        rows = sorted(rows, key=lambda row: (row[1].start_version, row[0]))
    head = [(idx, g) for idx, g in rows if g.state != GroupState.CLAIMED][:count]
    if len(head) < count or any(g.state != GroupState.READY for _, g in head):
        return []  # a gated sampler waits rather than skip the head of its order
    return [idx for idx, _ in head]


def assert_gone(run: RunState, idx: int) -> None:
    """A trained or evicted group can be neither claimed nor trained (again)."""
    with pytest.raises(UnknownGroup):
        run.claim([idx], step=run.weight_version)
    with pytest.raises(UnknownGroup):
        run.commit_step([idx])


# ---- the state machine --------------------------------------------------------------------


class RunMachine(RuleBasedStateMachine):
    def __init__(self, sampler: str, level: str, planes: Callable[[], DataPlane]) -> None:
        super().__init__()
        self.planes = planes
        self.sampler = sampler
        self.level = level
        # tmp_path is per test, not per hypothesis example: each example gets its own dir.
        self._tmp = tempfile.TemporaryDirectory(prefix="rollsafe-props-")
        self.store = SnapshotStore(Path(self._tmp.name), RUN_ID)
        self.model = RunModel()
        self.snapshots: list[ModelSnapshot] = []  # kept by retention, oldest first
        self.checkpoints = 0
        self.config: RunConfig | None = None
        self.state: RunState | None = None
        self.checkpoints_at_restore = 0

    def teardown(self) -> None:
        self._tmp.cleanup()

    @initialize(
        group_size=st.sampled_from([3, 2, 1]),  # 1 can never be partly sealed: rarest
        groups_per_step=st.integers(1, 2),
        staleness_window=st.integers(0, 2),
    )
    def start(self, group_size: int, groups_per_step: int, staleness_window: int) -> None:
        self.config = RunConfig(
            run_id=RUN_ID,
            group_size=group_size,
            groups_per_step=groups_per_step,
            sampler=self.sampler,
            staleness_window=staleness_window,
            restore_level=self.level,
        )
        self.state = RunState(self.config, self.planes())

    # ---- helpers --------------------------------------------------------------------------

    @property
    def run(self) -> RunState:
        assert self.state is not None
        return self.state

    def live(self) -> bool:
        return self.state is not None

    def groups_with(self, *states: str) -> list[int]:
        return sorted(idx for idx, g in self.model.groups.items() if g.siblings_in(*states))

    def _dispatch(self, idx: int, i: int) -> None:
        group = self.model.groups[idx]
        rollout = group.rollouts[i]
        episode = self.run.dispatch(idx, i)
        assert episode.attempt == rollout.attempt
        rollout.state = DISPATCHED
        if not group.started:
            # The group is stamped with the version it starts generating under.
            group.started = True
            group.start_version = self.model.weight_version

    def _seal(self, idx: int, i: int) -> None:
        rollout = self.model.groups[idx].rollouts[i]
        # The attempt comes from the model: a seal with a stale attempt must not apply.
        row = row_content(idx, i, rollout.attempt)
        assert self.run.seal(idx, i, rollout.attempt, row)
        rollout.state = SEALED
        # A repeated seal (a retried report) is a no-op; other content is refused.
        assert self.run.seal(idx, i, rollout.attempt, row) is False
        with pytest.raises(SealConflict):
            self.run.seal(idx, i, rollout.attempt, row_content(idx, i, rollout.attempt + 1))

    # ---- the run --------------------------------------------------------------------------

    # Few groups at a time, so that rules finish and train them rather than only hand out.
    @precondition(lambda self: self.live() and len(self.model.groups) < MAX_OWNED)
    @rule(offsets=st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True))
    def handout(self, offsets: list[int]) -> None:
        # Offsets from the loader position leave gaps (never owed), in any order.
        groups = [self.model.loader_position + off for off in offsets]
        self.run.handout(groups)
        for idx in groups:
            self.model.handed_out.add(idx)
            self.model.groups[idx] = ModelGroup(
                level=self.level,
                start_version=self.model.weight_version,
                rollouts=[ModelRollout() for _ in range(self.run.config.group_size)],
            )
        self.model.loader_position = max(groups) + 1

    @precondition(lambda self: self.live() and self.groups_with(RESERVED))
    @rule(data=st.data())
    def dispatch(self, data: st.DataObject) -> None:
        """Dispatch without sealing: the attempt is in flight when a checkpoint comes."""
        idx = data.draw(st.sampled_from(self.groups_with(RESERVED)), label="group")
        siblings = self.model.groups[idx].siblings_in(RESERVED)
        for i in data.draw(st.lists(st.sampled_from(siblings), min_size=1, unique=True)):
            self._dispatch(idx, i)

    @precondition(lambda self: self.live() and self.groups_with(DISPATCHED))
    @rule(data=st.data())
    def seal(self, data: st.DataObject) -> None:
        idx = data.draw(st.sampled_from(self.groups_with(DISPATCHED)), label="group")
        siblings = self.model.groups[idx].siblings_in(DISPATCHED)
        for i in data.draw(st.lists(st.sampled_from(siblings), min_size=1, unique=True)):
            self._seal(idx, i)

    @precondition(lambda self: self.live() and self.groups_with(RESERVED, DISPATCHED))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        """The scenario format's commit: dispatch when reserved, then seal."""
        idx = data.draw(st.sampled_from(self.groups_with(RESERVED, DISPATCHED)), label="group")
        siblings = self.model.groups[idx].siblings_in(RESERVED, DISPATCHED)
        # Either the whole rest of the group (it gets READY and can be trained) or a strict
        # part of it (a partly sealed group is what restore levels treat differently).
        partly = st.lists(
            st.sampled_from(siblings), min_size=1, max_size=max(1, len(siblings) - 1), unique=True
        )
        for i in data.draw(st.just(siblings) | partly, label="siblings"):
            if self.model.groups[idx].rollouts[i].state == RESERVED:
                self._dispatch(idx, i)
            self._seal(idx, i)

    @precondition(lambda self: self.live() and self.model.in_states(GroupState.READY))
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        ready = self.model.in_states(GroupState.READY)
        groups = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
        self.run.claim(groups, step=self.model.weight_version)
        for idx in groups:
            self.model.groups[idx].claimed = True

    def _train(self, groups: list[int]) -> None:
        # Checked before the step: a group already trained in this lineage must never be
        # offered again (it would be its second committed step).
        assert not set(groups) & set(self.model.trained()), "group trained twice"
        self.run.commit_step(groups)
        self.model.trained_steps.append(list(groups))
        for idx in groups:
            del self.model.groups[idx]
        self.model.weight_version += 1
        # The run refuses to claim or train any of this lineage's trained groups again.
        for idx in {groups[0], self.model.trained()[0]}:
            assert_gone(self.run, idx)

    @precondition(
        lambda self: self.live() and self.model.in_states(GroupState.READY, GroupState.CLAIMED)
    )
    @rule(data=st.data())
    def train(self, data: st.DataObject) -> None:
        trainable = self.model.in_states(GroupState.READY, GroupState.CLAIMED)
        self._train(data.draw(st.lists(st.sampled_from(trainable), min_size=1, unique=True)))

    # With nothing READY every sampler waits; that case teaches nothing.
    @precondition(lambda self: self.live() and self.model.in_states(GroupState.READY))
    @rule()
    def claim_what_the_sampler_selects(self) -> None:
        """The trainer's own flow: select, claim for the next step, commit later (train)."""
        selected = self.run.select()
        # What the controller offers a step must never have been trained (or dropped) in
        # this lineage; beyond that it must be exactly what the sampler's rules pick.
        assert not set(selected) & (set(self.model.trained()) | self.model.evicted)
        assert selected == expected_selection(self.model, self.run.config)
        if selected:
            self.run.claim(selected, step=self.model.weight_version)
            for idx in selected:
                self.model.groups[idx].claimed = True

    def evictable(self) -> list[int]:
        # The run drops groups that fell out of the staleness window (in any state but
        # CLAIMED: a claimed group belongs to a step in progress).
        assert self.config is not None
        return sorted(
            idx
            for idx, g in self.model.groups.items()
            if g.state != GroupState.CLAIMED
            and self.model.weight_version - g.start_version > self.config.staleness_window
        )

    @precondition(lambda self: self.live() and self.evictable())
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        evictable = self.evictable()
        idx = data.draw(st.sampled_from(evictable), label="group")
        self.run.evict(idx)
        del self.model.groups[idx]
        self.model.evicted.add(idx)

    # A version bump only matters to the staleness of groups the run owns.
    @precondition(lambda self: self.live() and self.model.groups)
    @rule(bump=st.integers(0, 3))
    def set_weight_version(self, bump: int) -> None:
        self.model.weight_version += bump
        self.run.set_weight_version(self.model.weight_version)

    # ---- checkpoint, crash, restore -------------------------------------------------------

    def changed_since_checkpoint(self) -> bool:
        return not self.snapshots or self.snapshots[-1].model != self.model

    # Checkpointing an unchanged run again would only crowd out the interesting rules.
    @precondition(lambda self: self.live() and self.changed_since_checkpoint())
    @rule()
    def checkpoint(self) -> None:
        self.checkpoints += 1
        checkpoint_id = f"props-checkpoint-{self.checkpoints}"
        manifest = state_files.checkpoint(self.run, self.store, checkpoint_id=checkpoint_id)
        assert (manifest.loader_position, manifest.weight_version) == (
            self.model.loader_position,
            self.model.weight_version,
        )
        name = snapshot_dir_name(manifest.seq, manifest.kind)
        self.snapshots.append(ModelSnapshot(name, checkpoint_id, copy.deepcopy(self.model)))
        # Retention keeps the newest KEEP_LATEST published snapshots (damaged ones count,
        # since their manifests still read back).
        self.snapshots = self.snapshots[-KEEP_LATEST:]
        published = sorted(e.name for e in self.store.list(verify=False) if e.seq is not None)
        assert published == [s.name for s in self.snapshots]

    @precondition(
        lambda self: len(self.snapshots) >= 2 and not any(s.corrupted for s in self.snapshots)
    )
    @rule(data=st.data())
    def corrupt_newest_snapshot(self, data: st.DataObject) -> None:
        """Damage one file of the newest snapshot: restore must fall back to an older one."""
        newest = self.snapshots[-1]
        path = self.store.snapshots_dir / newest.name
        files = sorted(
            str(p.relative_to(path))
            for p in path.rglob("*")
            if p.is_file() and p.name != "manifest.json"
        )
        target = path / data.draw(st.sampled_from(files), label="file")
        raw = bytearray(target.read_bytes())
        raw[len(raw) // 2] ^= 0xFF  # same size: only the digest check can notice
        target.chmod(0o644)
        target.write_bytes(bytes(raw))
        newest.corrupted = True

    def restorable(self) -> bool:
        return any(not s.corrupted for s in self.snapshots)

    def checkpointed_since_restore(self) -> bool:
        return self.checkpoints > self.checkpoints_at_restore

    # Each crash restores a snapshot not restored before; crashing more often would mostly
    # undo the work since the last one. Without a snapshot there is nothing to test.
    @precondition(
        lambda self: self.live() and self.restorable() and self.checkpointed_since_restore()
    )
    @rule()
    def crash(self) -> None:
        self.state = None  # every in-memory object is gone, the data plane included

    # Restoring a live run is the same as crashing first: a restore starts from the disk.
    @precondition(lambda self: not self.live())
    @rule(level=st.sampled_from(LEVELS))
    def restore(self, level: str) -> None:
        """The restarted run may be configured with another restore level: it applies to
        groups handed out from now on, never to the groups the snapshot recorded."""
        assert self.config is not None
        self.level = level
        self.config = self.config.model_copy(update={"restore_level": level})
        chosen = next(s for s in reversed(self.snapshots) if not s.corrupted)
        # Only the damaged snapshots newer than the chosen one were tried and refused.
        newer = self.snapshots[self.snapshots.index(chosen) + 1 :]
        expected = expected_restore(chosen.model)
        controller, plan = state_files.restore(
            self.config, SnapshotStore(self.store.root, RUN_ID), self.planes()
        )
        assert plan.snapshot == chosen.name
        assert plan.checkpoint_id == chosen.checkpoint_id
        assert set(plan.skipped) == {s.name for s in newer}
        self.check_owed_back(controller, plan, chosen.model, expected)
        self.check_sealed_stays_sealed(controller, plan, expected)
        self.check_trained_once(controller, plan, expected)
        self.state, self.model = controller, expected.model
        self.checkpoints_at_restore = self.checkpoints

    def check_owed_back(
        self, run: RunState, plan: RestorePlan, at_snapshot: RunModel, expected: ExpectedRestore
    ) -> None:
        owed = at_snapshot.owed()
        assert set(at_snapshot.groups) == owed, "reference model disagrees with invariant 1"
        assert run.index.groups() == sorted(owed)
        assert run.ledger.groups() == sorted(owed)
        assert run.loader_position == plan.loader_position == at_snapshot.loader_position
        assert run.weight_version == plan.weight_version == at_snapshot.weight_version
        for idx, group in expected.model.groups.items():
            # The version a group started under decides its staleness: it must come back.
            assert run.index.start_version(idx) == group.start_version, f"group {idx}"

    def check_sealed_stays_sealed(
        self, run: RunState, plan: RestorePlan, expected: ExpectedRestore
    ) -> None:
        model = expected.model
        sealed = {(idx, i) for idx, g in model.groups.items() for i in g.siblings_in(SEALED)}
        assert set(run.dataplane.list(PARTITION)) == {row_key(idx, i) for idx, i in sealed}
        assert not expected.dropped_keys & set(run.dataplane.list(PARTITION))
        rows = run.dataplane.get(PARTITION, sorted(row_key(idx, i) for idx, i in sealed))
        for idx, i in sealed:
            attempt = model.groups[idx].rollouts[i].attempt
            assert run.ledger.state(idx, i) == AttemptState.SEALED, (idx, i)
            assert run.ledger.attempt(idx, i) == attempt, (idx, i)
            assert same_row(rows[row_key(idx, i)], row_content(idx, i, attempt)), (idx, i)
        assert set(plan.partial) == set(expected.partial)
        for idx, (restored, regenerate) in expected.partial.items():
            got = plan.partial[idx]
            assert (got.restored, got.resumed, got.regenerate) == (restored, [], regenerate)
            # Nothing sealed is regenerated; everything unsealed is.
            assert sorted(run.ledger.unsealed(idx)) == sorted(got.regenerate + got.resumed)
            for i in regenerate:
                assert run.ledger.state(idx, i) == AttemptState.RESERVED, (idx, i)
                assert run.ledger.attempt(idx, i) == model.groups[idx].rollouts[i].attempt
        assert plan.redispatch == expected.redispatch
        # A late report from an attempt that was out there at the crash is refused: only
        # the new attempt may seal a regenerated rollout.
        for idx, group in expected.model.groups.items():
            for i in group.siblings_in(RESERVED):
                stale = group.rollouts[i].attempt - 1
                if stale >= 0:
                    with pytest.raises(SealConflict):
                        run.seal(idx, i, stale, row_content(idx, i, stale))

    def check_trained_once(
        self, run: RunState, plan: RestorePlan, expected: ExpectedRestore
    ) -> None:
        trained = expected.model.trained()
        assert len(trained) == len(set(trained)), f"a group trained twice: {trained}"
        assert not set(trained) & set(run.index.groups())
        assert plan.released_claims == expected.released
        for idx in expected.released:
            assert run.index.state(idx) == GroupState.READY, f"claimed group {idx}"
        assert plan.ready == expected.model.in_states(GroupState.READY)
        # Neither this lineage's trained groups nor its evicted ones can be trained again.
        for idx in set(trained) | expected.model.evicted:
            assert_gone(run, idx)
        # Every other group is back in its state (the per-step invariant checks the rest).
        for idx, group in expected.model.groups.items():
            assert run.index.state(idx) == group.state, f"group {idx}"

    # ---- checked after every step ---------------------------------------------------------

    @invariant()
    def controller_matches_the_model(self) -> None:
        """Early, precise failures: the live controller agrees with the model at every step."""
        if self.state is None:
            return
        run, model = self.state, self.model
        assert (run.loader_position, run.weight_version) == (
            model.loader_position,
            model.weight_version,
        )
        assert run.index.groups() == sorted(model.groups)
        for idx, group in model.groups.items():
            assert run.index.state(idx) == group.state, f"group {idx}"
            assert run.ledger.states(idx) == [_ATTEMPT_STATES[r.state] for r in group.rollouts]
            assert [run.ledger.attempt(idx, i) for i in range(len(group.rollouts))] == [
                r.attempt for r in group.rollouts
            ]
        assert set(run.dataplane.list(PARTITION)) == model.sealed_keys()
        trained = model.trained()
        assert len(trained) == len(set(trained)), f"a group trained twice: {trained}"


@pytest.mark.parametrize("first_level", LEVELS)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_random_runs_keep_invariants_1_to_3(
    sampler: str, first_level: str, dataplane_factory: Callable[[], DataPlane]
) -> None:
    # Parametrized rather than drawn, so that every sampler meets every level on each run.
    backend = dataplane_factory().name
    run_state_machine_as_test(
        lambda: RunMachine(sampler, first_level, dataplane_factory),  # type: ignore[arg-type]  # hypothesis types a class, documents any factory
        settings=SETTINGS[backend],
    )
