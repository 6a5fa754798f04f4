"""The RunState end to end on the memory data plane: checkpoint to disk, restore from it."""

import hashlib
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rollsafe.dataplane.columnar as columnar_module
import rollsafe.snapshot._fs as fs_module
import rollsafe.snapshot.select as select_module
from rollsafe.core.config import RunConfig
from rollsafe.core.ids import snapshot_dir_name
from rollsafe.core.phases import RestorePlan
from rollsafe.core.run_state import ROLLOUT_PARTITION, EnvironmentsRestored, RunState
from rollsafe.core.states import AttemptState, GroupState
from rollsafe.dataplane import make_dataplane
from rollsafe.errors import (
    DataPlaneKeyMissing,
    InvalidInput,
    LedgerInvariantViolation,
    NoValidSnapshot,
    RowMismatch,
    SealConflict,
    TopologyMismatch,
    UnknownGroup,
)
from rollsafe.evidence.scenario import row_content
from rollsafe.snapshot import SnapshotStore, state_files

RUN = "ctl"


def config(**overrides: Any) -> RunConfig:
    return RunConfig(**{"run_id": RUN, "group_size": 2, "groups_per_step": 2, **overrides})


def commit(run: RunState, idx: int, i: int, owner: str | None = None) -> None:
    if run.ledger.state(idx, i) == AttemptState.RESERVED:
        run.dispatch(idx, i, owner)
    attempt = run.ledger.attempt(idx, i)
    run.seal(idx, i, attempt, row_content(idx, i, attempt))


def busy_run(**overrides: Any) -> RunState:
    """Groups 0-1 ready, 2 half done, 3 never dispatched; one step committed."""
    run = RunState(config(**overrides), make_dataplane("memory"))
    run.handout([0, 1, 2, 3, 4])
    for idx in (0, 1, 4):
        commit(run, idx, 0)
        commit(run, idx, 1)
    commit(run, 2, 0)
    run.dispatch(2, 1)
    run.commit_step([4])
    return run


def restore(store: SnapshotStore, **overrides: Any) -> tuple[RunState, RestorePlan]:
    return state_files.restore(config(**overrides), store, make_dataplane("memory"))


def test_checkpoint_and_restore_round_trip(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    manifest = state_files.checkpoint(busy_run(), store, "ck-1")
    assert manifest.counts == {
        "groups": 4,
        "sealed_rollouts": 5,
        "claimed_groups": 0,
        "retirements": 0,
    }
    run, plan = restore(store)
    assert (plan.loader_position, plan.weight_version) == (5, 1)
    assert plan.ready == [0, 1]
    assert {g: p.model_dump() for g, p in plan.partial.items()} == {
        2: {"restored": [0], "resumed": [], "regenerate": [1]},
        3: {"restored": [], "resumed": [], "regenerate": [0, 1]},
    }
    assert plan.redispatch == [2, 3]  # the admitted (generating) group first
    assert run.ledger.episode(2, 1).key == "ctl-2_g1-a1"  # the in-flight attempt was retired
    assert [r.episode.key for r in run.ledger.retirements()] == ["ctl-2_g1"]
    row = run.dataplane.get(ROLLOUT_PARTITION, ["ctl-2_g0"])["ctl-2_g0"]
    assert row["tokens"].tobytes() == row_content(2, 0, 0)["tokens"].tobytes()


def test_restore_falls_back_to_the_newest_snapshot_that_verifies(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    run = busy_run()
    state_files.checkpoint(run, store, "ck-1")
    commit(run, 2, 1)
    newest = state_files.checkpoint(run, store, "ck-2")
    shard = next(
        (store.snapshots_dir / snapshot_dir_name(newest.seq, "rollout")).rglob("*.safetensors")
    )
    shard.write_bytes(shard.read_bytes()[:-1])  # truncated
    _, plan = restore(store)
    assert plan.checkpoint_id == "ck-1"
    assert any("ck-2" in name or f"{newest.seq:08d}" in name for name in plan.skipped)
    assert 2 in plan.partial  # the state of ck-1, where group 2 was still half done


@pytest.mark.parametrize("which", ["ledger.safetensors", "dataplane/"])
def test_a_file_changed_in_place_sends_the_restore_to_the_previous_snapshot(
    tmp_path: Path, which: str
) -> None:
    """Same size, one bit flipped: select (which hashes nothing for a restore) takes the
    snapshot; loading it finds the file, clears what it imported and takes the previous one."""
    store = SnapshotStore(tmp_path, RUN)
    run = busy_run()
    state_files.checkpoint(run, store, "ck-1")
    commit(run, 2, 1)
    newest = state_files.checkpoint(run, store, "ck-2")
    snapshot = store.snapshots_dir / snapshot_dir_name(newest.seq, "rollout")
    files = sorted(p for p in snapshot.rglob("*") if p.is_file())
    target = next(p for p in files if which in p.as_posix())
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    run, plan = restore(store)
    assert plan.checkpoint_id == "ck-1"
    assert "sha256" in plan.skipped[snapshot.name]
    assert run.dataplane.count(ROLLOUT_PARTITION) == 5  # ck-1: group 2 half done


def test_a_restore_hashes_each_byte_of_the_snapshot_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bytes hashed are the bytes loaded: one read and one hash per file (and the
    manifest), where select used to hash every file before the loads hashed them again."""
    store = SnapshotStore(tmp_path, RUN)
    manifest = state_files.checkpoint(busy_run(), store, "ck-1")
    snapshot = store.snapshots_dir / snapshot_dir_name(manifest.seq, "rollout")
    hashed = count_hashed_bytes(monkeypatch)
    restore(store)
    files = sum(entry.bytes for entry in manifest.files.values())
    assert hashed == [files + (snapshot / "manifest.json").stat().st_size]


def count_hashed_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the bytes every sha256 of the snapshot and data-plane readers is fed."""
    total = [0]

    class Counted:
        def __init__(self, data: bytes | memoryview = b"") -> None:
            self._hash = hashlib.sha256()
            self.update(data)

        def update(self, data: bytes | memoryview) -> None:
            total[0] += len(data)
            self._hash.update(data)

        def hexdigest(self) -> str:
            return self._hash.hexdigest()

    counting = types.SimpleNamespace(sha256=Counted)
    for module in (select_module, fs_module, columnar_module):
        monkeypatch.setattr(module, "hashlib", counting)
    return total


def test_restore_with_no_snapshot_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(NoValidSnapshot, match="no snapshot"):
        restore(SnapshotStore(tmp_path, RUN))


@pytest.mark.parametrize(("field", "value"), [("group_size", 4), ("sampler", "in_order")])
def test_restore_refuses_a_different_topology(tmp_path: Path, field: str, value: int | str) -> None:
    store = SnapshotStore(tmp_path, RUN)
    state_files.checkpoint(busy_run(), store, "ck-1")
    with pytest.raises((TopologyMismatch, InvalidInput), match=field):
        restore(store, **{field: value})


def test_a_row_that_verifies_but_differs_is_named(
    tmp_path: Path,
    resign: Callable[[Path, str, Callable[[bytes], bytes]], None],
    flip_a_token: Callable[[bytes], bytes],
    snapshot_tree: Callable[[Path], dict[str, str]],
) -> None:
    store = SnapshotStore(tmp_path, RUN)
    manifest = state_files.checkpoint(busy_run(), store, "ck-1")
    snapshot = store.snapshots_dir / snapshot_dir_name(manifest.seq, "rollout")
    shard = next(p for p in snapshot.rglob("*.safetensors") if "dataplane" in str(p))
    relpath = str(shard.relative_to(snapshot))

    resign(snapshot, relpath, flip_a_token)
    before = snapshot_tree(tmp_path)
    with pytest.raises(RowMismatch, match=r"group \d+ rollout \d+ \(ctl-\d+_g\d\)"):
        restore(store)
    assert snapshot_tree(tmp_path) == before


def test_checkpoint_refuses_an_inconsistent_run_and_publishes_nothing(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    run = busy_run()
    run.dataplane.delete(ROLLOUT_PARTITION, ["ctl-0_g0"])  # a row lost behind our back
    with pytest.raises(LedgerInvariantViolation, match="holds 4 rollout rows but 5 are sealed"):
        state_files.checkpoint(run, store, "ck-1")
    assert store.list() == []
    assert not store.snapshots_dir.exists() or not any(store.snapshots_dir.iterdir())


def test_seal_is_idempotent_and_never_overwrites_a_row() -> None:
    run = busy_run()
    again = row_content(0, 0, 0)
    assert run.seal(0, 0, 0, again) is False
    with pytest.raises(SealConflict):
        run.seal(0, 0, 0, {"tokens": np.zeros(3, dtype=np.int32)})
    stored = run.dataplane.get(ROLLOUT_PARTITION, ["ctl-0_g0"])["ctl-0_g0"]
    assert stored["tokens"].tobytes() == again["tokens"].tobytes()


def test_train_and_evict_drop_rows_and_ownership() -> None:
    run = busy_run()
    run.claim([0], step=1)
    run.commit_step([0])
    run.evict(1)
    assert set(run.dataplane.list(ROLLOUT_PARTITION)) == {"ctl-2_g0"}
    assert run.index.groups() == [2, 3] and run.ledger.groups() == [2, 3]
    assert run.weight_version == 2
    with pytest.raises(UnknownGroup, match="group 0"):
        run.commit_step([0])


def test_handout_rules() -> None:
    run = busy_run()
    with pytest.raises(InvalidInput, match="below the loader position 5"):
        run.handout([4])
    with pytest.raises(InvalidInput, match="repeats"):
        run.handout([7, 7])
    run.handout([9])
    assert run.loader_position == 10 and run.index.state(9) == GroupState.RESERVED


def test_weight_version_never_goes_back() -> None:
    run = busy_run()
    with pytest.raises(InvalidInput, match="older than the current 1"):
        run.set_weight_version(0)


def test_turn_level_restore_resumes_on_the_same_instance(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    run = RunState(config(restore_level="turn"), make_dataplane("memory"))
    run.handout([0])
    commit(run, 0, 0, owner="env-1")
    episode = run.dispatch(0, 1, owner="env-2")
    state_files.checkpoint(run, store, "ck-1")
    restored, plan = state_files.restore(
        config(restore_level="turn"),
        store,
        make_dataplane("memory"),
        environments=EnvironmentsRestored({episode: "env-2"}),
    )
    assert plan.partial[0].model_dump() == {"restored": [0], "resumed": [1], "regenerate": []}
    assert restored.dispatch(0, 1, owner="env-2").key == "ctl-0_g1-a1"


def test_restored_episode_the_run_does_not_own_is_refused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, RUN)
    state_files.checkpoint(busy_run(restore_level="turn"), store, "ck-1")
    stranger = RunState(config(), make_dataplane("memory")).ledger.rollout_id(9, 0).episode(0)
    with pytest.raises(LedgerInvariantViolation, match="not owned"):
        state_files.restore(
            config(restore_level="turn"),
            store,
            make_dataplane("memory"),
            environments=EnvironmentsRestored({stranger: "env-1"}),
        )


def test_missing_row_read_is_an_error_not_a_short_read() -> None:
    run = busy_run()
    with pytest.raises(DataPlaneKeyMissing, match="ctl-3_g0"):
        run.dataplane.get(ROLLOUT_PARTITION, ["ctl-0_g0", "ctl-3_g0"])
