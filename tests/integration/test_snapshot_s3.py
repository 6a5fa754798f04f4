"""Snapshots on S3, over the real S3 protocol: s3fs against a moto server subprocess.

What this adds over tests/unit/test_snapshot_remote.py: the conditional create is S3's own
``PutObject`` with ``If-None-Match: *`` answered 412 by the server (not a local emulation),
and every upload, listing, download and delete goes over HTTP. ``rollsafe doctor``'s bucket
check and ``rollsafe snapshots list s3://...`` run against the same server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from rollsafe.doctor_checks import Status, check_storage  # noqa: E402
from rollsafe.errors import InvalidInput, NoValidSnapshot  # noqa: E402
from rollsafe.snapshot import SnapshotKind  # noqa: E402
from rollsafe.snapshot import _objects as objects  # noqa: E402
from rollsafe.snapshot.remote import RemoteSnapshotStore  # noqa: E402

RUN = "run-s3"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server for this module, stopped by its pid whatever happens."""
    port = _free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"moto server exited with {proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("moto server did not listen within 30 s")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def options(endpoint: str) -> dict[str, object]:
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "eu-west-1"},
        "skip_instance_cache": True,
        "use_listings_cache": False,
    }


@pytest.fixture
def url(options: dict[str, object]) -> str:
    bucket = f"rollsafe-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    return f"s3://{bucket}/snapshots"


def store_at(url: str, cache: Path, options: dict[str, object], **kw: object):
    return RemoteSnapshotStore(url, RUN, cache, storage_options=options, **kw)  # type: ignore[arg-type]


def publish(store: RemoteSnapshotStore, checkpoint_id: str, seq: int | None = None):
    draft = store.begin(SnapshotKind.ROLLOUT, checkpoint_id, seq)
    draft.write_bytes("state.bin", checkpoint_id.encode() * 100)
    (draft.path / "envs" / "inst-0").mkdir(parents=True)
    (draft.path / "envs" / "inst-0" / "export.json").write_bytes(b"{}")
    draft.record("envs")
    return draft.publish(weight_version=1, loader_position=10)


def test_s3_conditional_put_has_exactly_one_winner(url, options):
    fs, root = objects.open_filesystem(url, options)
    path = f"{root}/{RUN}/latest/00000001.json"
    assert objects.create_exclusive(fs, path, b"first")
    assert not objects.create_exclusive(fs, path, b"second")  # 412 from the server
    assert fs.cat_file(path) == b"first"

    barrier = threading.Barrier(6)
    results: list[bool] = []

    def create() -> None:
        barrier.wait()
        results.append(objects.create_exclusive(fs, f"{root}/race", b"x"))

    threads = [threading.Thread(target=create) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 5 + [True]


def test_s3_publish_select_round_trip_and_retention(url, options, tmp_path):
    store = store_at(url, tmp_path / "w", options, keep_latest_k=2)
    published = [publish(store, f"ck-{i}") for i in range(1, 4)]
    reader = store_at(url, tmp_path / "r", options).select()
    assert reader.name == "00000003-rollout"
    assert reader.manifest_sha256 == published[-1].manifest_sha256
    assert reader.read_bytes("state.bin") == b"ck-3" * 100
    assert reader.latest_problem is None
    names = [e.name for e in store.list(verify=False)]
    assert names == ["00000003-rollout", "00000002-rollout"]  # seq 1 retired


def test_s3_publish_dying_before_the_manifest_is_invisible(url, options, tmp_path):
    def crash(point: str) -> None:
        if point == "before_manifest":
            raise RuntimeError(point)

    store = store_at(url, tmp_path / "w", options, fault_hook=crash)
    with pytest.raises(RuntimeError):
        publish(store, "ck-1")
    with pytest.raises(NoValidSnapshot) as caught:
        store_at(url, tmp_path / "r", options).select()
    assert "unpublished" in caught.value.reasons["00000001-rollout"]


def test_s3_corrupted_object_is_refused_by_name(url, options, tmp_path):
    store = store_at(url, tmp_path / "w", options)
    publish(store, "ck-1")
    publish(store, "ck-2")
    store.fs.pipe_file(f"{store.remote_run}/snapshots/00000002-rollout/state.bin", b"x" * 400)
    reader = store_at(url, tmp_path / "r", options).select()
    assert reader.name == "00000001-rollout"
    assert "state.bin: sha256 does not match" in reader.skipped["00000002-rollout"]


def test_s3_two_publishers_of_one_seq_exactly_one_wins(url, options, tmp_path):
    drafts = []
    for i in range(2):
        draft = store_at(url, tmp_path / f"h{i}", options).begin(
            SnapshotKind.ROLLOUT, f"ck-{i}", seq=1
        )
        draft.write_bytes("state.bin", f"host {i}".encode() * 1000)
        drafts.append(draft)
    barrier = threading.Barrier(2)
    won, refused = [], []

    def run(draft) -> None:
        barrier.wait()
        try:
            won.append(draft.publish(weight_version=1, loader_position=1))
        except InvalidInput as exc:
            refused.append(exc)

    threads = [threading.Thread(target=run, args=(d,)) for d in drafts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1 and len(refused) == 1
    reader = store_at(url, tmp_path / "r", options).select()
    assert reader.manifest.checkpoint_id == won[0].manifest.checkpoint_id
    assert reader.latest_problem is None


# -- the doctor and the CLI on a bucket ------------------------------------------------------


def test_s3_doctor_passes_on_a_healthy_bucket_and_leaves_nothing(url, options):
    check = check_storage(url, 5.0, options)
    assert check.status is Status.OK, check
    assert "second create refused" in check.detail  # the server answered 412
    fs, root = objects.open_filesystem(url, options)
    assert fs.find(root) == []


def test_s3_doctor_names_a_missing_bucket(options):
    missing = f"s3://rollsafe-missing-{uuid.uuid4().hex[:12]}/snapshots"
    check = check_storage(missing, 5.0, options)
    assert check.status is Status.FAILED
    assert check.detail.startswith(f"{missing}: create of a probe object failed")
    assert "bucket does not exist" in check.detail
    assert "does not exist" in check.fix and "create it" in check.fix


def test_s3_snapshots_list_from_the_command_line(url, options, endpoint, tmp_path):
    """A separate process, credentials and endpoint from the environment as in production."""
    publish(store_at(url, tmp_path / "w", options), "ck-1")
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "eu-west-1",
    }
    command = [sys.executable, "-m", "rollsafe", "snapshots", "list", url, "--run", RUN]
    listing = subprocess.run(
        command, capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert listing.returncode == 0, listing.stderr
    assert "00000001-rollout" in listing.stdout and "ck-1" in listing.stdout


def test_s3_the_controller_actor_publishes_through_its_cache(
    url, options, endpoint, tmp_path, ray_session
):
    """The run's controller as a Ray actor with an s3:// root: drafts staged in its cache, the
    snapshot in the bucket (credentials and endpoint from the actor's environment, as on a Ray
    node), restored by this process through a cache of its own."""
    from rollsafe.actor import start_controller_actor
    from rollsafe.config import RunConfig
    from rollsafe.controller import Controller
    from rollsafe.dataplane import make_dataplane
    from rollsafe.phases import PHASES, PhaseRequest, SnapshotSpec
    from rollsafe.scenario import row_content

    ray = ray_session
    config = RunConfig(run_id=RUN, group_size=2, groups_per_step=2)
    aws = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "eu-west-1",
    }
    actor = start_controller_actor(
        RUN,
        config,
        url,
        snapshot_cache=tmp_path / "actor-cache",
        runtime_env={"env_vars": aws},
    )
    try:
        ray.get(actor.handout.remote([0, 1]))
        episode = ray.get(actor.dispatch.remote(0, 0))
        ray.get(actor.seal.remote(0, 0, episode.attempt, row_content(0, 0, 0)))
        spec = SnapshotSpec(run_id=RUN, seq=1)
        for phase in PHASES:
            result = ray.get(actor.run_phase.remote(PhaseRequest(spec=spec, phase=phase)))
        info = result.published
        assert info is not None and info.counts["sealed_rollouts"] == 1
    finally:
        ray.kill(actor)
    assert list((tmp_path / "actor-cache" / RUN / "snapshots").iterdir())  # staged there
    store = store_at(url, tmp_path / "reader-cache", options)
    assert [entry.name for entry in store.list()] == [info.name]
    _, plan = Controller.restore(config, store, make_dataplane("memory"))
    assert (plan.snapshot, plan.ready, sorted(plan.partial)) == (info.name, [], [0, 1])
