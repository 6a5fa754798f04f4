"""Each restore level's fallback, end to end on the reference run's real processes: a snapshot
is taken while a step generates, everything is killed, fresh servers are started and the run is
restored from that snapshot and finished. Every run must pass ``rollsafe verify`` against an
uninterrupted run with the same seed (same tokens for every rollout), and each level must have
resumed exactly as finely as it promises:

- ``prefix``: an episode resumed on its instance continues its cut call from the staged prefix;
- ``turn``: an episode resumed on its instance regenerates only its interrupted turn (the earlier
  turns' mutations keep the old attempt's call ids, nothing comes from a prefix);
- ``sibling``: the siblings sealed at the snapshot are kept as they were; only the others run
  again, from scratch;
- ``prompt_group``: a group caught half sealed is generated again whole.

Nothing is left to timing: the first run's engine holds the calls each level needs caught
(``ROLLSAFE_ENGINE_HOLD``: after their first token, until a cut), so the one snapshot taken
once the run is ready always finds what the level is about, on an idle or a loaded machine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from rollsafe.checkpoint.phases.commit_envs import RECORD_FILE, ParticipantsRecord
from rollsafe.core.ids import checkpoint_id_for
from rollsafe.core.ledger import Ledger
from rollsafe.core.phases import Phase, PhaseResult, RestorePlan
from rollsafe.core.states import AttemptState
from rollsafe.engine.loop import HoldRule
from rollsafe.engine.staging import PREFIX_PARTITION
from rollsafe.env.client import EnvClient
from rollsafe.env.protocol import EpisodeRef, PrepareRequest, ResumeRequest
from rollsafe.evidence.files import Evidence, TrainedRow
from rollsafe.evidence.verify import verify
from rollsafe.reference.rl.controller import Endpoints
from rollsafe.reference.rl.run import SNAPSHOTS_DIR, ReferenceRun, RunSettings
from rollsafe.reference.rl.servers import RunServers
from rollsafe.snapshot import SnapshotStore, state_files
from rollsafe.testing.waiting import eventually

INSTANCES = ("w0", "w1", "w2")
# What each level makes of the *snapshot* (checked against its ledger): the journal off, since
# with it the seals made between the snapshot and the crash (as many as the timing allows)
# come back too (tests/integration/test_participants.py has the journal's counterpart).
BASE = RunSettings(
    run_id="lv", seed=11, steps=2, group_size=4, groups_per_step=2, turns=4, journal=False
)
CRASH_STEP = 0  # the first run's engine holds calls from the start: its first step is caught
# Calls the first run's engine holds after their first token until a cut (attempt 0 only: an
# attempt's key has no -a<n> suffix, so restored attempts run free).
EVERY_CALL = HoldRule(calls=r"_g\d+/t\d+")
AFTER_A_TURN = HoldRule(calls=r"_g\d+/t[1-9]\d*")  # turn 0 runs to its end
FIRST_SIBLING = HoldRule(calls=r"_g0/t\d+")  # the other siblings seal meanwhile


class Crash(Exception):
    pass


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture
def servers(logs: Path, request: pytest.FixtureRequest) -> Iterator[RunServers]:
    running = RunServers(
        logs / request.node.name,
        INSTANCES,
        seed=BASE.seed,
        engine_token="lv-engine",
        env_token="lv-env",
        max_tokens=48,
    )
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def reference(logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Evidence:
    """The uninterrupted run every level must match token for token."""
    root = tmp_path_factory.mktemp("reference")
    servers = RunServers(
        logs / "reference", INSTANCES, seed=BASE.seed, engine_token="e", env_token="v",
        max_tokens=48,
    )  # fmt: skip
    try:
        run = ReferenceRun(BASE, servers.start(), root, root / "out")
        try:
            run.run()
            run.finish()
        finally:
            run.close()
    finally:
        servers.stop()
    return Evidence.read(root / "out")


def snapshot_ledger(root: Path) -> Ledger:
    """The ledger as the newest published snapshot holds it."""
    reader = SnapshotStore(root / SNAPSHOTS_DIR, BASE.run_id).select()
    return Ledger.restore(*state_files.read_state(reader).ledger, reader.name)


def mixed_groups(ledger: Ledger) -> list[int]:
    """Groups with some siblings sealed and some not."""
    mixed = []
    for idx in ledger.groups():
        sealed = [s == AttemptState.SEALED for s in ledger.states(idx)]
        if any(sealed) and not all(sealed):
            mixed.append(idx)
    return mixed


Ready = Callable[[ReferenceRun], bool]
Caught = Callable[[dict[Phase, PhaseResult], Path], bool]


def calls_held(run: ReferenceRun) -> bool:
    return run.loop.run(run.engine.info()).held > 0


def some_sibling_sealed(run: ReferenceRun) -> bool:
    assert run.local is not None
    with run.local.barrier:
        return bool(mixed_groups(run.local.state.ledger))


def crashed_and_restored(
    level: str,
    servers: RunServers,
    root: Path,
    hold: HoldRule,
    ready: Ready,
    caught: Caught,
    busy_during_restore: str | None = None,
    restore_onto: Sequence[str] | None = None,
) -> tuple[RestorePlan, Ledger, Evidence]:
    """One snapshot during step CRASH_STEP, taken once ``ready`` (the first run's engine
    ``hold``s calls, so the state it waits for stays put), must have ``caught`` what the level
    needs; then everything is killed, restored on fresh servers and run to the end. With
    ``busy_during_restore``, that instance is parked by another checkpoint while the restore
    runs (so it refuses to restore); with ``restore_onto``, the fresh servers are that fleet."""
    settings = BASE.model_copy(update={"restore_level": level})
    out = root / "out"
    first = ReferenceRun(settings, servers.start(hold=hold), root, out)

    def during(step: int) -> None:
        if step != CRASH_STEP:
            return
        eventually(lambda: ready(first), what=f"the first run ready for the {level} snapshot")
        results = first.snapshot()
        assert caught(results, root), {phase: r.summary for phase, r in results.items()}
        servers.crash()
        raise Crash

    try:
        with pytest.raises(Crash):
            first.run(during=during)
    finally:
        first.close()
    at_snapshot = snapshot_ledger(root)
    endpoints = servers.start(instances=restore_onto)
    release = park_elsewhere(endpoints, busy_during_restore) if busy_during_restore else None
    second, plan = ReferenceRun.restored(settings, endpoints, root, out)
    if release is not None:
        release()
    assert second.local is not None  # the staged prefixes live on in the snapshot only
    assert second.local.state.dataplane.count(PREFIX_PARTITION) == 0
    try:
        second.run()
        second.finish()
    finally:
        second.close()
    return plan, at_snapshot, Evidence.read(out)


def park_elsewhere(endpoints: Endpoints, instance: str) -> Callable[[], None]:
    """Park ``instance`` under another checkpoint id; returns what resumes it."""
    other = checkpoint_id_for("elsewhere", 1, "rollout")

    async def call(request: PrepareRequest | ResumeRequest) -> None:
        async with EnvClient(endpoints.envs[instance], endpoints.env_token) as client:
            if isinstance(request, PrepareRequest):
                assert (await client.prepare(request)).ready
            else:
                await client.resume(request)

    asyncio.run(call(PrepareRequest(checkpoint_id=other, deadline_ts=time.time() + 60)))
    return lambda: asyncio.run(call(ResumeRequest(checkpoint_id=other)))


def assert_same_tokens_once(evidence: Evidence, reference: Evidence) -> None:
    checks = verify(evidence, reference)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]


def rows_by_rollout(evidence: Evidence) -> dict[str, TrainedRow]:
    return {row.rollout_id: row for row in evidence.trained}


def call_ids(evidence: Evidence, rollout_id: str) -> dict[int, str]:
    return {m.turn: m.call_id for m in evidence.mutations if m.rollout_id == rollout_id}


def resumed_rollouts(plan: RestorePlan, ledger: Ledger) -> list[tuple[str, int]]:
    """(rollout id, attempt at the snapshot) of every episode resumed on its instance."""
    return [
        (ledger.rollout_id(idx, i).key, ledger.attempt(idx, i))
        for idx, group in plan.partial.items()
        for i in group.resumed
    ]


def test_prefix_level_resumes_the_cut_call_mid_way(
    servers: RunServers, tmp_path: Path, reference: Evidence
) -> None:
    plan, ledger, evidence = crashed_and_restored(
        "prefix",
        servers,
        tmp_path,
        EVERY_CALL,
        calls_held,
        lambda results, _: results[Phase.CUT_GENERATION].counts["cut"] > 0,
    )
    assert_same_tokens_once(evidence, reference)
    resumed = resumed_rollouts(plan, ledger)
    assert resumed
    rows = rows_by_rollout(evidence)
    assert all(rows[rid].attempt == attempt + 1 for rid, attempt in resumed)
    assert sum(rows[rid].restored_prefix_tokens for rid, _ in resumed) > 0


def mid_call_after_a_turn(results: dict[Phase, PhaseResult], root: Path) -> bool:
    """The snapshot committed an episode with a turn done and its next call in flight, and
    cut no call (turn level: calls in flight are skipped, never cut)."""
    cut = results[Phase.CUT_GENERATION].counts
    if cut["cut"] or not cut["skipped"]:
        return False
    snapshot = SnapshotStore(root / SNAPSHOTS_DIR, BASE.run_id).select().path
    for records in snapshot.glob("envs/*/*/records-*.jsonl"):
        for line in records.read_text().splitlines():
            state = json.loads(line)["state"]
            if state["turn"] >= 1 and state["in_flight"] is not None:
                return True
    return False


def test_turn_level_regenerates_only_the_interrupted_turn(
    servers: RunServers, tmp_path: Path, reference: Evidence
) -> None:
    plan, ledger, evidence = crashed_and_restored(
        "turn",
        servers,
        tmp_path,
        AFTER_A_TURN,
        calls_held,
        mid_call_after_a_turn,
    )
    assert_same_tokens_once(evidence, reference)
    assert all(row.restored_prefix_tokens == 0 for row in evidence.trained)
    resumed = resumed_rollouts(plan, ledger)
    assert resumed
    rows = rows_by_rollout(evidence)
    split = 0
    for rid, attempt in resumed:
        assert rows[rid].attempt == attempt + 1
        old, new = f"{rid}-a{attempt}" if attempt else rid, f"{rid}-a{attempt + 1}"
        ids = call_ids(evidence, rid)
        old_turns = sorted(t for t, call in ids.items() if call.startswith(f"{old}/"))
        new_turns = sorted(t for t, call in ids.items() if call.startswith(f"{new}/"))
        # Turns done before the snapshot stay done; only what follows ran again.
        assert old_turns == list(range(len(old_turns)))
        assert new_turns == list(range(len(old_turns), BASE.turns))
        split += bool(old_turns) and bool(new_turns)
    assert split, "no resumed episode kept earlier turns and regenerated a later one"


def sibling_sealed_at_snapshot(results: dict[Phase, PhaseResult], root: Path) -> bool:
    return bool(mixed_groups(snapshot_ledger(root)))


def test_sibling_level_keeps_the_sealed_siblings(
    servers: RunServers, tmp_path: Path, reference: Evidence
) -> None:
    plan, ledger, evidence = crashed_and_restored(
        "sibling",
        servers,
        tmp_path,
        FIRST_SIBLING,
        some_sibling_sealed,
        sibling_sealed_at_snapshot,
    )
    assert_same_tokens_once(evidence, reference)
    assert not resumed_rollouts(plan, ledger)  # no episode comes back from an environment
    assert all(row.restored_prefix_tokens == 0 for row in evidence.trained)
    rows = rows_by_rollout(evidence)
    for idx in mixed_groups(ledger):
        states = ledger.states(idx)
        sealed = [i for i, s in enumerate(states) if s == AttemptState.SEALED]
        assert plan.partial[idx].restored == sealed
        for i, state in enumerate(states):
            row = rows[ledger.rollout_id(idx, i).key]
            if state == AttemptState.SEALED:
                assert row.attempt == ledger.attempt(idx, i)  # kept, not generated again
            else:
                assert row.attempt > ledger.attempt(idx, i)


def test_prompt_group_level_regenerates_the_whole_group(
    servers: RunServers, tmp_path: Path, reference: Evidence
) -> None:
    plan, ledger, evidence = crashed_and_restored(
        "prompt_group",
        servers,
        tmp_path,
        FIRST_SIBLING,
        some_sibling_sealed,
        sibling_sealed_at_snapshot,
    )
    assert_same_tokens_once(evidence, reference)
    assert not resumed_rollouts(plan, ledger)
    rows = rows_by_rollout(evidence)
    for idx in mixed_groups(ledger):
        assert plan.partial[idx].restored == []
        assert plan.partial[idx].regenerate == list(range(BASE.group_size))
        for i in range(BASE.group_size):  # sealed ones too: a new attempt, the same tokens
            assert rows[ledger.rollout_id(idx, i).key].attempt == ledger.attempt(idx, i) + 1


def test_a_failed_environment_restore_restarts_those_rollouts_from_scratch(
    servers: RunServers, tmp_path: Path, reference: Evidence
) -> None:
    """An instance that cannot restore (busy with another checkpoint) fails the environments'
    restore on every instance (all or nothing): the controller's restore still succeeds, and
    the episodes committed in the snapshot restart from scratch, past their retired n + 1."""
    plan, ledger, evidence = crashed_and_restored(
        "prefix",
        servers,
        tmp_path,
        EVERY_CALL,
        calls_held,
        lambda results, _: results[Phase.COMMIT_ENVS].counts["committed_episodes"] > 0,
        busy_during_restore="w0",
    )
    assert "w0" in plan.environments_failed
    assert not resumed_rollouts(plan, ledger)
    assert_same_tokens_once(evidence, reference)
    rows = rows_by_rollout(evidence)
    reader = SnapshotStore(tmp_path / SNAPSHOTS_DIR, BASE.run_id).select()
    record = reader.read_json(RECORD_FILE, ParticipantsRecord)
    committed = [ref for c in record.committed.instances.values() for ref in c.committed]
    assert committed
    for ref in committed:  # committed at attempt n: n + 1 is retired everywhere
        row = rows[ref.rollout_id]
        assert row.attempt == ref.attempt + 2 and row.restored_prefix_tokens == 0


def every_call_held(run: ReferenceRun) -> bool:
    """Every episode of the step waits in a held call: each one's cut stages a prefix."""
    return run.loop.run(run.engine.info()).held == BASE.group_size * BASE.groups_per_step


def committed_on(root: Path, instance: str) -> list[EpisodeRef]:
    reader = SnapshotStore(root / SNAPSHOTS_DIR, BASE.run_id).select()
    return list(
        reader.read_json(RECORD_FILE, ParticipantsRecord).committed.instances[instance].committed
    )


def test_an_instance_lost_for_good_has_its_episodes_resumed_on_the_survivors(
    servers: RunServers, tmp_path: Path, reference: Evidence
) -> None:
    """w2 never comes back and w3 is new: the episodes w2 committed resume on the fleet's
    least loaded instances (w3, with nothing of its own to restore) from w2's records, their
    cut calls from the staged prefixes on the new engine; the plan says where; every
    rollout's tokens are the uninterrupted run's, once."""
    plan, ledger, evidence = crashed_and_restored(
        "prefix",
        servers,
        tmp_path,
        EVERY_CALL,
        every_call_held,
        lambda results, root: bool(committed_on(root, "w2")),
        restore_onto=("w0", "w1", "w3"),
    )
    assert_same_tokens_once(evidence, reference)
    lost = committed_on(tmp_path, "w2")
    assert set(plan.environments_lost) == {"w2"}
    assert f"{len(lost)} episode(s) restored on" in plan.environments_lost["w2"]
    assert not plan.environments_failed
    resumed = set(resumed_rollouts(plan, ledger))
    assert {(ref.rollout_id, ref.attempt) for ref in lost} <= resumed
    rows = rows_by_rollout(evidence)
    ran_on = {(m.rollout_id, m.call_id.split("/")[0]): m.instance for m in evidence.mutations}
    for ref in lost:
        adopter = ran_on[(ref.rollout_id, f"{ref.rollout_id}-a{ref.attempt + 1}")]
        assert adopter in {"w0", "w1", "w3"} and f"{adopter} (" in plan.environments_lost["w2"]
        assert rows[ref.rollout_id].attempt == ref.attempt + 1
    assert sum(rows[ref.rollout_id].restored_prefix_tokens for ref in lost) > 0
