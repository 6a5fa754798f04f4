"""Snapshots on object storage (rollsafe.snapshot.remote) over fsspec's memory:// and file://.

The S3 and GCS protocols themselves (conditional creates against moto and fake-gcs-server)
are exercised in tests/integration/test_snapshot_object_storage.py; these run without any
server.
"""

from __future__ import annotations

import hashlib
import importlib
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

fsspec = pytest.importorskip("fsspec")

from rollsafe.checkpoint.controller import Controller  # noqa: E402
from rollsafe.core.config import RunConfig  # noqa: E402
from rollsafe.core.ids import checkpoint_id_for  # noqa: E402
from rollsafe.core.phases import PHASES, Phase, PhaseRequest, RestoreRequest, SnapshotSpec  # noqa: E402
from rollsafe.core.states import AttemptState  # noqa: E402
from rollsafe.dataplane import make_dataplane  # noqa: E402
from rollsafe.errors import (  # noqa: E402
    CheckpointRefused,
    InjectedFault,
    InvalidInput,
    NoValidSnapshot,
    SnapshotCorrupt,
    SnapshotLost,
)
from rollsafe.evidence.scenario import busy_run, row_content  # noqa: E402
from rollsafe.faults import arm, disarm_all  # noqa: E402
from rollsafe.snapshot import (  # noqa: E402
    MANIFEST_NAME,
    PublishedSnapshot,
    SnapshotKind,
    SnapshotStore,
    accept_weight_versions,
    state_files,
)
from rollsafe.snapshot import _objects as objects  # noqa: E402
from rollsafe.snapshot.location import open_snapshot_store  # noqa: E402
from rollsafe.snapshot.remote import RemoteSnapshotStore  # noqa: E402
from rollsafe.snapshot.select import EntryState  # noqa: E402
from rollsafe.testing.race import all_at_once  # noqa: E402

RUN = "run-remote"


class Crash(Exception):
    pass


@pytest.fixture
def url() -> Iterator[str]:
    """A fresh memory:// bucket per test (the memory filesystem is one per process)."""
    bucket = f"memory://rollsafe-{uuid.uuid4().hex[:12]}"
    yield bucket
    fs = fsspec.filesystem("memory")
    root = fs._strip_protocol(bucket)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def store_at(url: str, cache: Path, **kwargs: Any) -> RemoteSnapshotStore:
    return RemoteSnapshotStore(url, RUN, cache, **kwargs)


def publish(
    store: SnapshotStore,
    checkpoint_id: str,
    seq: int | None = None,
    files: dict[str, bytes] | None = None,
) -> PublishedSnapshot:
    draft = store.begin(SnapshotKind.ROLLOUT, checkpoint_id, seq)
    for relpath, data in (files or {"state.bin": checkpoint_id.encode()}).items():
        draft.write_bytes(relpath, data)
    return draft.publish(weight_version=1, loader_position=10)


def remote_keys(store: RemoteSnapshotStore) -> list[str]:
    base = store.remote_run + "/"
    return sorted(p[len(base) :] for p in store.fs.find(store.remote_run) if p.startswith(base))


# -- publish, select, verify ---------------------------------------------------------------


def test_publish_uploads_files_then_manifest_and_select_round_trips(
    url: str, tmp_path: Path
) -> None:
    store = store_at(url, tmp_path / "writer")
    draft = store.begin(SnapshotKind.ROLLOUT, "ck-1")
    draft.write_bytes("state.bin", b"state")
    # an environment server writes its export into the draft itself, then it is recorded
    env_dir = draft.path / "envs" / "inst-0"
    env_dir.mkdir(parents=True)
    (env_dir / "episodes.json").write_bytes(b'{"episodes": []}')
    draft.record("envs")
    published = draft.publish(weight_version=3, loader_position=7)

    assert published.name == "00000001-rollout" and not published.reused
    assert remote_keys(store) == [
        "claims/00000001.json",
        "latest/00000001.json",
        "snapshots/00000001-rollout/envs/inst-0/episodes.json",
        "snapshots/00000001-rollout/manifest.json",
        "snapshots/00000001-rollout/state.bin",
    ]
    # another machine: nothing cached, everything downloaded and verified
    reader = store_at(url, tmp_path / "restorer").select()
    assert reader.name == "00000001-rollout"
    assert reader.path.is_relative_to(tmp_path / "restorer")
    assert reader.read_bytes("state.bin") == b"state"
    assert reader.read_bytes("envs/inst-0/episodes.json") == b'{"episodes": []}'
    assert reader.manifest.weight_version == 3
    assert reader.manifest_sha256 == published.manifest_sha256
    assert reader.latest_problem is None and dict(reader.skipped) == {}
    pointer = store.latest_pointer()
    assert pointer is not None and pointer.snapshot == "00000001-rollout"


def test_the_next_seq_and_the_pointer_follow_the_remote_store(url: str, tmp_path: Path) -> None:
    first = store_at(url, tmp_path / "a")
    publish(first, "ck-1")
    second = store_at(url, tmp_path / "b")  # another machine, empty cache
    assert publish(second, "ck-2").name == "00000002-rollout"
    pointer = first.latest_pointer()
    assert pointer is not None and (pointer.seq, pointer.checkpoint_id) == (2, "ck-2")
    assert [e.name for e in first.list()] == ["00000002-rollout", "00000001-rollout"]
    assert {e.state for e in first.list()} == {EntryState.VALID}


def test_a_controller_restores_from_object_storage(url: str, tmp_path: Path) -> None:
    run = busy_run(RUN, make_dataplane("memory"))
    state_files.checkpoint(run, store_at(url, tmp_path / "trainer-host"), "ck-1")

    restored, plan = state_files.restore(
        run.config, store_at(url, tmp_path / "new-host"), make_dataplane("memory")
    )
    assert plan.loader_position == 3 and plan.ready == [0]
    assert restored.ledger.state(1, 0) == AttemptState.SEALED


# -- all or nothing ------------------------------------------------------------------------


@pytest.mark.parametrize("point", ["before_manifest", "before_rename"])
def test_a_publish_that_dies_before_the_manifest_leaves_nothing_visible(
    url: str, tmp_path: Path, point: str
) -> None:
    publish(store_at(url, tmp_path / "w0"), "ck-1")

    def crash(at: str) -> None:
        if at == point:
            raise Crash(at)

    store = store_at(url, tmp_path / "w1", fault_hook=crash)
    draft = store.begin(SnapshotKind.ROLLOUT, "ck-2")
    draft.write_bytes("state.bin", b"new state")
    with pytest.raises(Crash):
        draft.publish(weight_version=1, loader_position=10)

    # the files are up there, the manifest is not: the snapshot does not exist for readers
    assert "snapshots/00000002-rollout/state.bin" in remote_keys(store)
    assert "snapshots/00000002-rollout/manifest.json" not in remote_keys(store)
    reader = store_at(url, tmp_path / "r").select()
    assert reader.name == "00000001-rollout"
    assert "unpublished" in reader.skipped["00000002-rollout"]
    states = {e.name: e.state for e in store.list()}
    assert states == {"00000002-rollout": EntryState.TEMP, "00000001-rollout": EntryState.VALID}

    # the retried publish of the same checkpoint holds the claim and completes
    store._fault = None
    assert draft.publish(weight_version=1, loader_position=10).name == "00000002-rollout"
    assert store_at(url, tmp_path / "r2").select().name == "00000002-rollout"


def test_nothing_published_is_no_valid_snapshot_naming_the_url(url: str, tmp_path: Path) -> None:
    with pytest.raises(NoValidSnapshot, match=f"no snapshot under {url}/{RUN}/snapshots"):
        store_at(url, tmp_path).select()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda fs, p: fs.pipe_file(f"{p}/state.bin", b"tampered"), "state.bin"),
        (lambda fs, p: fs.pipe_file(f"{p}/state.bin", b"ck-X"), "state.bin: sha256 does not"),
        (lambda fs, p: fs.rm_file(f"{p}/state.bin"), "missing file(s): state.bin"),
        (lambda fs, p: fs.pipe_file(f"{p}/extra.bin", b"x"), "unlisted file(s): extra.bin"),
        (lambda fs, p: fs.pipe_file(f"{p}/{MANIFEST_NAME}", b"{"), "not valid JSON"),
    ],
    ids=["resized", "same-size", "missing", "unlisted", "manifest"],
)
def test_a_corrupted_object_is_refused_by_name(
    url: str, tmp_path: Path, damage: Callable[[Any, str], object], reason: str
) -> None:
    store = store_at(url, tmp_path / "w")
    publish(store, "ck-1")
    publish(store, "ck-2")
    damage(store.fs, f"{store.remote_run}/snapshots/00000002-rollout")

    reader = store_at(url, tmp_path / "r").select()
    assert reader.name == "00000001-rollout"
    why = reader.skipped["00000002-rollout"]
    assert why.startswith(f"{url}/{RUN}/snapshots/00000002-rollout: ") and reason in why
    assert (
        reader.latest_problem == "LATEST names 00000002-rollout, but 00000001-rollout was selected"
    )
    # nothing damaged is repaired, moved or deleted by a read
    assert "snapshots/00000002-rollout/manifest.json" in remote_keys(store)


def test_when_no_candidate_verifies_every_one_is_named(url: str, tmp_path: Path) -> None:
    store = store_at(url, tmp_path / "w")
    publish(store, "ck-1")
    store.fs.pipe_file(f"{store.remote_run}/snapshots/00000001-rollout/state.bin", b"ck-X")
    with pytest.raises(NoValidSnapshot) as caught:
        store_at(url, tmp_path / "r").select()
    assert "sha256 does not match" in caught.value.reasons["00000001-rollout"]


def test_an_object_key_outside_the_snapshot_grammar_is_refused(url: str, tmp_path: Path) -> None:
    store = store_at(url, tmp_path / "w")
    publish(store, "ck-1")
    store.fs.pipe_file(f"{store.remote_run}/snapshots/00000001-rollout/a/../b", b"x")
    with pytest.raises(NoValidSnapshot, match="not allowed"):
        store_at(url, tmp_path / "r").select()


# -- concurrent publishers -----------------------------------------------------------------


@pytest.fixture(params=["memory", "file"])
def any_url(request: pytest.FixtureRequest, url: str, tmp_path: Path) -> str:
    return url if request.param == "memory" else f"file://{tmp_path / 'bucket'}"


def test_conditional_create_has_exactly_one_winner(any_url: str) -> None:
    fs, root = objects.open_filesystem(any_url)
    path = f"{root}/{RUN}/latest/00000001.json"
    results = all_at_once(
        [partial(objects.create_exclusive, fs, path, f"writer {i}".encode()) for i in range(8)]
    )
    assert results.count(True) == 1 and results.count(False) == 7, results
    assert fs.cat_file(path).startswith(b"writer ")


def test_two_concurrent_publishers_of_one_seq_exactly_one_wins(
    any_url: str, tmp_path: Path
) -> None:
    stores = [store_at(any_url, tmp_path / f"host-{i}") for i in range(2)]
    drafts = []
    for i, store in enumerate(stores):
        draft = store.begin(SnapshotKind.ROLLOUT, f"ck-{i}", seq=5)
        draft.write_bytes("state.bin", f"state of host {i}".encode() * 1000)
        drafts.append(draft)
    outcomes = all_at_once(
        [partial(draft.publish, weight_version=1, loader_position=10) for draft in drafts]
    )
    won = [outcome for outcome in outcomes if not isinstance(outcome, Exception)]
    refused = [str(outcome) for outcome in outcomes if isinstance(outcome, InvalidInput)]
    assert len(won) == 1 and len(refused) == 1, outcomes
    winner = won[0].manifest.checkpoint_id
    assert "is claimed by checkpoint" in refused[0] or "already published" in refused[0]
    reader = store_at(any_url, tmp_path / "reader").select()
    assert reader.manifest.checkpoint_id == winner
    assert reader.read_bytes("state.bin") == f"state of host {winner[-1]}".encode() * 1000
    pointer = stores[0].latest_pointer()
    assert pointer is not None and pointer.checkpoint_id == winner
    assert reader.latest_problem is None


def test_republishing_a_seq_reuses_the_same_checkpoint_and_refuses_another(
    url: str, tmp_path: Path
) -> None:
    store = store_at(url, tmp_path / "w")
    first = publish(store, "ck-1", seq=1)
    again = publish(store_at(url, tmp_path / "w2"), "ck-1", seq=1)
    assert again.reused and again.manifest_sha256 == first.manifest_sha256
    with pytest.raises(InvalidInput, match="already published as 00000001-rollout"):
        publish(store_at(url, tmp_path / "w3"), "ck-other", seq=1)
    with pytest.raises(InvalidInput, match="older than the newest published seq"):
        publish(store_at(url, tmp_path / "w4"), "ck-3", seq=0)


# -- retention -----------------------------------------------------------------------------


def test_retention_keeps_the_newest_k_and_deletes_the_rest_everywhere(
    url: str, tmp_path: Path
) -> None:
    store = store_at(url, tmp_path / "w", keep_latest_k=2)
    for i in range(1, 5):
        publish(store, f"ck-{i}")
    keys = remote_keys(store)
    assert {k.split("/")[1] for k in keys if k.startswith("snapshots/")} == {
        "00000003-rollout",
        "00000004-rollout",
    }
    assert [k for k in keys if not k.startswith("snapshots/")] == [
        "claims/00000003.json",
        "claims/00000004.json",
        "latest/00000003.json",
        "latest/00000004.json",
    ]
    cached = sorted(p.name for p in store.snapshots_dir.iterdir() if not p.name.startswith("."))
    assert cached == ["00000003-rollout", "00000004-rollout"]


def test_retention_deletes_the_manifest_first(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_at(url, tmp_path / "w", keep_latest_k=1)
    publish(store, "ck-1")
    real_rm = store.fs.rm_file

    def rm_manifests_only(path: str) -> None:
        if not path.endswith(MANIFEST_NAME):
            raise PermissionError(path)  # retention dies right after the manifest went
        real_rm(path)

    monkeypatch.setattr(store.fs, "rm_file", rm_manifests_only)
    with pytest.raises(objects.ObjectStoreUnavailable):
        publish(store, "ck-2")
    monkeypatch.undo()
    # snapshot 1 lost its manifest and nothing else: invisible, never a candidate
    assert "snapshots/00000001-rollout/state.bin" in remote_keys(store)
    reader = store_at(url, tmp_path / "r").select()
    assert reader.name == "00000002-rollout"
    assert "unpublished" in reader.skipped["00000001-rollout"]
    publish(store, "ck-3")  # the next retention finishes the job
    assert not any("00000001" in k for k in remote_keys(store))


# -- configuration -------------------------------------------------------------------------


def test_an_unknown_scheme_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="unsupported snapshot storage scheme 'ftp'"):
        RemoteSnapshotStore("ftp://host/snaps", RUN, tmp_path)
    with pytest.raises(InvalidInput, match="scheme 'hdfs'"):
        open_snapshot_store("hdfs://nn/snaps", RUN, cache_dir=tmp_path)
    with pytest.raises(InvalidInput, match="needs a local cache_dir"):
        open_snapshot_store("s3://bucket/snaps", RUN)


def test_a_path_is_the_posix_store_and_a_url_the_object_store(url: str, tmp_path: Path) -> None:
    posix = open_snapshot_store(tmp_path / "shared", RUN)
    assert type(posix) is SnapshotStore and posix.root == tmp_path / "shared"
    assert type(open_snapshot_store(f"file://{tmp_path}/x", RUN)) is SnapshotStore
    remote = open_snapshot_store(url, RUN, cache_dir=tmp_path / "cache")
    assert isinstance(remote, RemoteSnapshotStore)


def test_uploads_are_read_back_and_checked(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_at(url, tmp_path / "w")
    real_put = store.fs.put_file

    def corrupting_put(lpath: str, rpath: str, **kwargs: Any) -> None:
        real_put(lpath, rpath, **kwargs)
        if rpath.endswith("state.bin"):
            store.fs.pipe_file(rpath, b"ck-X")  # same size, other bytes

    monkeypatch.setattr(store.fs, "put_file", corrupting_put)
    with pytest.raises(objects.ObjectStoreUnavailable, match="different sha256"):
        publish(store, "ck-1")
    assert "snapshots/00000001-rollout/manifest.json" not in remote_keys(store)


def test_a_hung_upload_is_abandoned_as_transient_and_the_retry_publishes(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload that never answers must not hold publish (and the controller's publish
    lock) forever: past its time limit it fails as transient, so Temporal retries."""
    monkeypatch.setattr(objects, "OBJECT_TIMEOUT_S", 0.2)
    store = store_at(url, tmp_path / "w")
    release = threading.Event()
    real_put = store.fs.put_file

    def hung_put(lpath: str, rpath: str, **kwargs: Any) -> Any:  # what fsspec's put_file gives
        release.wait(60)  # a connection that never answers
        return real_put(lpath, rpath, **kwargs)

    monkeypatch.setattr(store.fs, "put_file", hung_put)
    draft = store.begin(SnapshotKind.ROLLOUT, "ck-1")
    draft.write_bytes("state.bin", b"state")
    started = time.monotonic()
    try:
        with pytest.raises(objects.ObjectStoreUnavailable, match=r"upload of .*state\.bin: no "):
            draft.publish(weight_version=1, loader_position=1)
        assert time.monotonic() - started < 10
    finally:
        release.set()  # the abandoned call finishes: a late upload of the same bytes
    monkeypatch.setattr(store.fs, "put_file", real_put)
    assert objects.ObjectStoreUnavailable("x").transient
    published = draft.publish(weight_version=1, loader_position=1)  # the retry
    assert published.name == "00000001-rollout" and not published.reused
    assert store_at(url, tmp_path / "r").select().read_bytes("state.bin") == b"state"


def test_snapshot_digest_helper_matches_hashlib(url: str, tmp_path: Path) -> None:
    fs, root = objects.open_filesystem(url)
    fs.pipe_file(f"{root}/blob", b"x" * 3_000_000)
    entry = objects.hash_object(fs, f"{root}/blob")
    assert entry.bytes == 3_000_000
    assert entry.sha256 == hashlib.sha256(b"x" * 3_000_000).hexdigest()


def test_a_damaged_published_seq_blocks_republishing_it(url: str, tmp_path: Path) -> None:
    store = store_at(url, tmp_path / "w")
    publish(store, "ck-1", seq=1)
    store.fs.pipe_file(f"{store.remote_run}/snapshots/00000001-rollout/state.bin", b"ck-X")
    with pytest.raises(SnapshotCorrupt, match="already published and does not verify"):
        publish(store_at(url, tmp_path / "w2"), "ck-1", seq=1)


def test_a_missing_backend_package_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As if gcsfs were not installed (it is, for the GCS tests): None in sys.modules makes
    # every import of it raise ImportError, and fsspec forgets the class it may have cached.
    registry = importlib.import_module("fsspec.registry")
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    for protocol in ("gs", "gcs"):
        monkeypatch.delitem(registry._registry, protocol, raising=False)
    with pytest.raises(InvalidInput, match=r"'gcsfs' package.*object-storage"):
        RemoteSnapshotStore("gs://bucket/snaps", RUN, tmp_path)


def test_checkpoint_ops_publish_to_and_restore_from_object_storage(
    url: str, tmp_path: Path
) -> None:
    run = busy_run(RUN, make_dataplane("memory"))
    config = run.config
    ops = Controller.from_parts(run, store_at(url, tmp_path / "host-a"))
    spec = SnapshotSpec(run_id=RUN, seq=ops.next_seq())
    results = [ops.run_phase(PhaseRequest(spec=spec, phase=phase)) for phase in PHASES]
    info = results[-1].published
    assert info is not None and info.name == "00000001-rollout"

    # a new controller on another host, restoring from the bucket alone: the run's service
    # (what the Ray actor runs) given the bucket's URL
    other = Controller(config, url, snapshot_cache=tmp_path / "host-b")
    assert isinstance(other.store, RemoteSnapshotStore)
    assert other.status().awaiting_restore  # the bucket holds the run's snapshots
    plan = other.restore(RestoreRequest(run_id=RUN, restore_id="r-1"))
    assert (plan.snapshot, plan.checkpoint_id) == (info.name, info.checkpoint_id)
    assert other.state.ledger.state(1, 0) == AttemptState.SEALED
    assert other.next_seq() == 2


def test_a_publish_that_dies_after_the_manifest_is_published_and_its_retry_reuses_it(
    url: str, tmp_path: Path
) -> None:
    publish(store_at(url, tmp_path / "w0"), "ck-1")

    def crash(at: str) -> None:
        if at == "before_latest":
            raise Crash(at)

    with pytest.raises(Crash):
        publish(store_at(url, tmp_path / "w1", fault_hook=crash), "ck-2", seq=2)
    reader = store_at(url, tmp_path / "r").select()
    assert reader.name == "00000002-rollout"  # the manifest is the commit point
    assert reader.latest_problem == (
        "LATEST names 00000001-rollout, but 00000002-rollout was selected"
    )
    again = publish(store_at(url, tmp_path / "w2"), "ck-2", seq=2)
    assert again.reused and again.manifest_sha256 == reader.manifest_sha256
    assert store_at(url, tmp_path / "r2").select().latest_problem is None


def test_a_retried_publish_whose_cache_is_gone_reuses_the_snapshot_in_the_bucket(
    url: str, tmp_path: Path
) -> None:
    """A publish attempt created the manifest in the bucket, then failed; its retry runs
    where the local draft cache is gone (a wiped disk, another host): it downloads and
    verifies the published snapshot and reuses it, never refuses it as corrupt."""
    config = RunConfig(run_id=RUN, group_size=2, groups_per_step=2)
    cache = tmp_path / "host-a"
    ops = Controller(config, url, snapshot_cache=cache)
    ops.handout([0, 1])
    episode = ops.dispatch(0, 0)
    assert episode is not None
    ops.seal(0, 0, episode.attempt, row_content(0, 0, episode.attempt))
    spec = SnapshotSpec(run_id=RUN, seq=1)
    for phase in PHASES[:-1]:
        ops.run_phase(PhaseRequest(spec=spec, phase=phase))
    arm("store.before_latest", "raise")
    try:
        with pytest.raises(InjectedFault):
            ops.run_phase(PhaseRequest(spec=spec, phase=Phase.PUBLISH))
    finally:
        disarm_all()
    shutil.rmtree(cache)

    again = ops.run_phase(PhaseRequest(spec=spec, phase=Phase.PUBLISH))
    info = again.published
    assert info is not None and info.name == "00000001-rollout"
    assert again.summary == "reused the earlier publish of 00000001-rollout"
    assert Path(info.path).is_relative_to(cache)  # downloaded, verified, cached again
    # the same on another host, from the bucket alone
    other = Controller(config, url, snapshot_cache=tmp_path / "host-b")
    elsewhere = other.run_phase(PhaseRequest(spec=spec, phase=Phase.PUBLISH)).published
    assert elsewhere is not None
    assert elsewhere.manifest_sha256 == info.manifest_sha256
    # seq 1 belongs to the rollout checkpoint: any other checkpoint of it is refused
    trainer = SnapshotSpec(run_id=RUN, seq=1, kind="trainer")
    with pytest.raises(CheckpointRefused, match="published as 00000001-rollout by checkpoint"):
        other.run_phase(PhaseRequest(spec=trainer, phase=Phase.PUBLISH))


def test_a_retried_publish_finding_only_an_unfinished_upload_is_lost_not_corrupt(
    url: str, tmp_path: Path
) -> None:
    """Objects of seq 2 without a manifest (an upload that died) are not a published
    snapshot: the retry must start over (transient), not fail the run as corrupt."""
    publish(store_at(url, tmp_path / "w0"), "ck-1")

    def crash(at: str) -> None:
        if at == "before_manifest":
            raise Crash(at)

    with pytest.raises(Crash):
        publish(
            store_at(url, tmp_path / "w1", fault_hook=crash),
            checkpoint_id_for(RUN, 2, "rollout"),
            2,
        )
    config = RunConfig(run_id=RUN, group_size=2, groups_per_step=2)
    fresh = Controller(config, url, snapshot_cache=tmp_path / "host-b")
    spec = SnapshotSpec(run_id=RUN, seq=2)
    with pytest.raises(SnapshotLost, match="seq 2 is not published") as caught:
        fresh.run_phase(PhaseRequest(spec=spec, phase=Phase.PUBLISH))
    assert caught.value.transient


def test_accept_is_asked_before_a_candidate_is_downloaded(url: str, tmp_path: Path) -> None:
    store = store_at(url, tmp_path / "w")
    for weight_version in (1, 2):
        draft = store.begin(SnapshotKind.ROLLOUT, f"ck-{weight_version}")
        draft.write_bytes("state.bin", b"s")
        draft.publish(weight_version=weight_version, loader_position=1)
    reader_store = store_at(url, tmp_path / "r")
    reader = reader_store.select(accept_weight_versions([1]))
    assert reader.name == "00000001-rollout"
    assert reader.skipped["00000002-rollout"].startswith("not accepted: no trainer checkpoint")
    assert not (reader_store.snapshots_dir / "00000002-rollout").exists()
