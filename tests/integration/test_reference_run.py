"""The reference run end to end on real processes (an engine server and three workplace
environment servers): deterministic GRPO steps, a snapshot mid-generation, everything killed
in a later step, a restore onto fresh servers, and the evidence of the restored run checked by
``rollsafe verify`` alone and against an uninterrupted run with the same seed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rollsafe.core.phases import Phase
from rollsafe.engine.loop import HoldRule
from rollsafe.evidence.files import TRAINED, Evidence, FaultRecord, TrainedRow, read_lines
from rollsafe.evidence.verify import verify
from rollsafe.reference.rl.run import ReferenceRun, RunSettings
from rollsafe.reference.rl.servers import RunServers
from rollsafe.testing.waiting import eventually

ENGINE_TOKEN, ENV_TOKEN = "rr-engine", "rr-env"
INSTANCES = ("w0", "w1", "w2")
SETTINGS = RunSettings(run_id="rr", seed=5, steps=3, group_size=2, groups_per_step=2, turns=4)
STEP_1_CALLS = HoldRule(from_weight_version=1)
# The same, but a cut ends the hold only for the calls it froze: a snapshot taken in step 0
# cuts a call whenever one is in flight at its prepare, and with ``once`` that first cut would
# end the hold for step 1's calls too (none was ever held: a flaky "a call held" timeout).
STEP_1_CALLS_PAST_A_CUT = HoldRule(from_weight_version=1, once=False)


class Crash(Exception):
    """The whole run is killed here (servers SIGKILLed, the run's objects dropped)."""


@contextmanager
def run_servers(logs: Path) -> Iterator[RunServers]:
    running = RunServers(
        logs,
        INSTANCES,
        seed=SETTINGS.seed,
        engine_token=ENGINE_TOKEN,
        env_token=ENV_TOKEN,
        max_tokens=48,  # calls long enough to be caught mid-generation
    )
    try:
        yield running
    finally:
        running.stop()


def run_until_crash(run: ReferenceRun, faults: Callable[[int], None]) -> None:
    """Run until ``faults`` raises :class:`Crash`; the run's clients closed whatever happens."""
    try:
        with pytest.raises(Crash):
            run.run(during=faults)
    finally:
        run.close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[RunServers]:
    with run_servers(tmp_path / "logs") as running:
        yield running


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The evidence of an uninterrupted run with :data:`SETTINGS`' seed, which every
    deterministic run here must match token for token."""
    root = tmp_path_factory.mktemp("reference")
    with run_servers(root / "logs") as servers:
        run = ReferenceRun(SETTINGS, servers.start(), root, root / "out")
        try:
            run.run()
            run.finish()
        finally:
            run.close()
    return root / "out"


def test_a_run_crashed_and_restored_trains_the_same_tokens_exactly_once(
    servers: RunServers, reference: Path, tmp_path: Path
) -> None:
    root, out = tmp_path, tmp_path / "out"
    # The snapshot's own restore path (cut calls resumed from their prefixes): without the
    # journal, whose seals after the snapshot would leave nothing to resume (docs/journal.md).
    settings = SETTINGS.model_copy(update={"journal": False})
    # Step 1's calls (weight version 1) stop after a token until the snapshot's cut.
    first = ReferenceRun(settings, servers.start(hold=STEP_1_CALLS), root, out)

    def faults(step: int) -> None:
        if step == 1:  # mid-generation: episodes parked, calls cut
            eventually(lambda: first.loop.run(first.engine.info()).held, what="a call held")
            assert first.snapshot()[Phase.CUT_GENERATION].counts["cut"]
        if step == 2:
            servers.crash()
            raise Crash

    run_until_crash(first, faults)
    assert all(r.published is not None for r in first.snapshots)
    assert {row.step for row in read_lines(out / TRAINED, TrainedRow)} == {0, 1}

    second, plan = ReferenceRun.restored(settings, servers.start(), root, out)
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


def test_a_restore_that_rolls_a_step_back_generates_the_next_step_with_its_retrained_weights(
    servers: RunServers, reference: Path, tmp_path: Path
) -> None:
    """With the journal and a trainer checkpoint every 2 steps, a run killed while step 1
    generates restores the snapshot at weight version 0 and the journal after it, step 0's
    commit rolled back. The restored run owns step 1's groups too (handed out after that
    commit, still generating): they must wait for step 0 to be trained again, not generate at
    once with the weights before it (they did: tokens differed from the reference run's)."""
    settings = SETTINGS.model_copy(update={"checkpoint_every": 2})
    root, out = tmp_path, tmp_path / "out"
    first = ReferenceRun(settings, servers.start(hold=STEP_1_CALLS_PAST_A_CUT), root, out)

    def faults(step: int) -> None:
        if step == 0:
            assert first.snapshot()[Phase.PUBLISH].published is not None
        if step == 1:  # step 1's calls are in flight (held after a token): kill everything
            eventually(lambda: first.loop.run(first.engine.info()).held, what="a call held")
            servers.crash()
            raise Crash

    run_until_crash(first, faults)

    second, plan = ReferenceRun.restored(settings, servers.start(), root, out)
    try:
        assert plan.weight_version == 0
        assert plan.journal is not None and plan.journal.rolled_back_groups == [0, 1]
        second.run()
        second.finish()
    finally:
        second.close()

    evidence = Evidence.read(out)
    checks = verify(evidence, Evidence.read(reference))
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert {row.step for row in evidence.rolled_back} == {0}


ASYNC = SETTINGS.model_copy(
    update={
        "run_id": "rr-async",
        "steps": 4,
        "sampler": "windowed",
        "staleness_window": 1,
        "ahead_steps": 1,
        "checkpoint_every": 2,
    }
)


def test_an_async_run_restores_from_a_snapshot_its_trainer_checkpoint_anchors(
    servers: RunServers, tmp_path: Path
) -> None:
    """Generation runs a step ahead of training; the trainer checkpoints every 2 steps, so of
    the snapshots taken at weight versions 1, 2 and 3 only version 2's can be restored."""
    assert not ASYNC.deterministic
    root, out = tmp_path, tmp_path / "out"
    first = ReferenceRun(ASYNC, servers.start(), root, out)

    def faults(step: int) -> None:
        if step >= 1:
            published = first.snapshot()[Phase.PUBLISH].published
            assert published is not None and published.weight_version == step
        if step == 3:
            servers.crash()
            raise Crash

    run_until_crash(first, faults)
    assert first.anchors() == [0, 2]

    second, plan = ReferenceRun.restored(ASYNC, servers.start(), root, out)
    try:
        assert plan.weight_version == 2
        # With the journal: the newest snapshot at or below the trainer's weights (2), then
        # the journal, the step trained after them rolled back.
        assert [why for why in plan.skipped.values()] == [
            "not accepted: its weight version 3 is past the trainer's 2"
        ]
        assert plan.journal is not None and plan.journal.rolled_back_groups
        second.run()
        report = second.finish()
    finally:
        second.close()

    assert report.deterministic is False and report.sampler == "windowed"
    evidence = Evidence.read(out)
    checks = verify(evidence)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert sorted({row.step for row in evidence.trained}) == [0, 1, 2, 3]
    assert {row.step for row in evidence.rolled_back} == {2}  # committed after version 2
    # Generation ran ahead: more groups were handed out than the steps trained.
    assert len(evidence.handed_out) > ASYNC.steps * ASYNC.groups_per_step
