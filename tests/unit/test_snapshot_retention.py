"""Retention that keeps what a restore needs (rollsafe.snapshot.retention): the newest k, the
newest snapshot at each anchor still held, damaged ones left for an operator. The rule alone,
then on the POSIX store and on object storage (memory://) with a trainer that checkpoints
every few steps while a snapshot is taken every step."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollsafe.core.ids import checkpoint_id_for, snapshot_dir_name
from rollsafe.errors import NoValidSnapshot
from rollsafe.snapshot import EntryState, SnapshotKind, SnapshotStore, accept_weight_versions
from rollsafe.snapshot.retention import plan_retention

RUN = "retained"


def names(*seqs: int) -> list[tuple[int, str]]:
    return [(seq, snapshot_dir_name(seq, "rollout")) for seq in seqs]


def test_without_anchors_the_newest_k_are_kept() -> None:
    versions = {name: seq for seq, name in names(1, 2, 3, 4, 5)}
    plan = plan_retention(names(3, 1, 5, 2, 4), versions.get, keep_latest_k=2)
    assert sorted(plan.keep) == ["00000004-rollout", "00000005-rollout"]
    assert plan.delete == ("00000003-rollout", "00000002-rollout", "00000001-rollout")
    assert plan.cut == 4


def test_the_newest_snapshot_at_each_anchor_is_kept_however_old() -> None:
    # seq -> weight version: two snapshots at version 3, one at 6, then later ones
    version = {1: 3, 2: 3, 3: 4, 4: 5, 5: 6, 6: 7, 7: 8}
    read = {name: version[seq] for seq, name in names(*version)}.get
    plan = plan_retention(names(*version), read, keep_latest_k=2, anchors=[3, 6, 99])
    assert sorted(plan.keep) == [snapshot_dir_name(seq, "rollout") for seq in (2, 5, 6, 7)]
    assert set(plan.delete) == {snapshot_dir_name(seq, "rollout") for seq in (1, 3, 4)}
    assert plan.cut == 6  # anchor 99 has no snapshot: nothing is kept for it


def test_a_damaged_snapshot_is_left_when_newer_than_the_cut_and_never_counted() -> None:
    read = {"00000005-rollout": None, "00000004-rollout": 1, "00000002-rollout": None}
    plan = plan_retention(names(2, 3, 4, 5, 6), lambda name: read.get(name, 1), 2)
    assert sorted(plan.keep) == ["00000004-rollout", "00000005-rollout", "00000006-rollout"]
    assert plan.delete == ("00000003-rollout", "00000002-rollout")


def test_with_fewer_than_k_readable_nothing_is_deleted() -> None:
    plan = plan_retention(names(1, 2, 3), lambda name: None if name < "00000003" else 1, 2)
    assert plan.delete == () and plan.cut is None and len(plan.keep) == 3


def test_manifests_are_read_only_while_they_can_change_the_answer() -> None:
    reads: list[str] = []

    def read(name: str) -> int:
        reads.append(name)
        return int(name[:8])  # weight version = seq

    plan_retention(names(*range(1, 11)), read, keep_latest_k=2)
    assert reads == ["00000010-rollout", "00000009-rollout"]
    reads.clear()
    plan_retention(names(*range(1, 11)), read, keep_latest_k=2, anchors=[7])
    assert reads == [snapshot_dir_name(seq, "rollout") for seq in (10, 9, 8, 7)]


# ---- on the stores: anchors every 3 steps, a snapshot every step -----------------------------


@pytest.fixture(params=["posix", "memory"])
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[int], SnapshotStore]]:
    def posix(keep: int) -> SnapshotStore:
        return SnapshotStore(tmp_path / "snapshots", RUN, keep_latest_k=keep)

    if request.param == "posix":
        yield posix
        return
    fsspec = pytest.importorskip("fsspec")
    from rollsafe.snapshot.remote import RemoteSnapshotStore

    bucket = f"memory://retention-{uuid.uuid4().hex[:12]}"

    def remote(keep: int) -> SnapshotStore:
        return RemoteSnapshotStore(bucket, RUN, tmp_path / "cache", keep_latest_k=keep)

    yield remote
    fs = fsspec.filesystem("memory")
    if fs.exists(fs._strip_protocol(bucket)):
        fs.rm(fs._strip_protocol(bucket), recursive=True)


def publish_at(store: SnapshotStore, seq: int, weight_version: int, anchors: set[int]) -> None:
    draft = store.begin(SnapshotKind.ROLLOUT, checkpoint_id_for(RUN, seq, "rollout"), seq)
    draft.write_bytes("state.bin", f"{seq}".encode())
    draft.publish(weight_version=weight_version, loader_position=seq, anchors=anchors)


def train(store: SnapshotStore, steps: int, *, declare_anchors: bool) -> set[int]:
    """Step s commits weight version s; the trainer checkpoints every 3rd version and keeps
    its two newest checkpoints; a snapshot is published after every step. Returns the
    anchors held at the end."""
    held: set[int] = set()
    for version in range(1, steps + 1):
        if version % 3 == 0:
            held = {*sorted(held)[-1:], version}  # saved one, removed the third-newest
        publish_at(store, version, version, held if declare_anchors else set())
        for anchor in held:  # after every publish: each anchor still restorable
            if declare_anchors:
                reader = store.select(accept_weight_versions([anchor]))
                assert reader.manifest.weight_version == anchor
    return held


def test_an_anchored_restore_always_finds_its_snapshot(
    make_store: Callable[[int], SnapshotStore],
) -> None:
    store = make_store(2)
    held = train(store, 14, declare_anchors=True)
    assert held == {9, 12}
    kept = sorted(entry.name for entry in store.list() if entry.state == EntryState.VALID)
    # the newest two, and the newest at each held anchor; the released anchors' are gone
    assert kept == [snapshot_dir_name(seq, "rollout") for seq in (9, 12, 13, 14)]


def test_without_anchors_periodic_snapshots_push_the_anchored_one_out(
    make_store: Callable[[int], SnapshotStore],
) -> None:
    """What retention did before it knew of anchors: the restore anchored to the trainer's
    newest checkpoint finds nothing to restore."""
    store = make_store(2)
    held = train(store, 14, declare_anchors=False)
    with pytest.raises(NoValidSnapshot, match="no trainer checkpoint of its weight version 13"):
        store.select(accept_weight_versions(held))
