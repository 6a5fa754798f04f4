"""A run whose processes are of two releases, the previous one (0.1.0, unpacked from
tests/fixtures/releases) and this checkout, on a real Temporal dev server and Ray (issue 35):

- *upgrade*: a trainer of the previous release; its checkpoint workers rolled from the previous
  release to this one in the middle of a snapshot (the first worker dies as publish begins);
- *rollback*: a trainer of this release; its workers rolled back to the previous release in
  the middle of a snapshot.

The snapshot in flight is finished by the other release's worker (which replays the first
one's workflow history and calls the other release's controller actor), the next snapshot
publishes, every group is trained once, and this release reads every snapshot either wrote.
Each process gets its release from ``PYTHONPATH`` (the previous one's package ahead of the
installed one); both take their dependencies from this virtualenv.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollsafe import __version__
from rollsafe.dataplane.tq_runtime import RAY_ENV
from rollsafe.faults import EXIT_CODE
from rollsafe.snapshot import EntryState, SnapshotStore
from rollsafe.temporal.devserver import DevServer
from rollsafe.testing.workers import stop_process, wait_worker_ready, worker_process

pytestmark = pytest.mark.timeout(300)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PREVIOUS_WHEEL = FIXTURES / "releases" / "rollsafe-0.1.0-py3-none-any.whl"
TRAINER = FIXTURES / "mixed_trainer.py"
STEPS, SNAPSHOT_AFTER = 4, (1, 3)
DIES_AT = "worker.phase.publish.before"  # the first worker's end: a snapshot mid-way


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's package, unpacked from its wheel."""
    where = tmp_path_factory.mktemp("release-0.1.0")
    with zipfile.ZipFile(PREVIOUS_WHEEL) as wheel:
        wheel.extractall(where)
    return where


def start_trainer(
    release: Path | None, run_id: str, root: Path, out: Path, log: Path, server: DevServer
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TEMPORAL_", "RAY_"))}
    env.update(
        TEMPORAL_ADDRESS=server.address,
        TEMPORAL_NAMESPACE=server.namespace,
        TEMPORAL_CONFIG_FILE=str(log.parent / "no-temporal-config.toml"),
        **RAY_ENV,  # as the workers' (rollsafe.testing.workers): no Ray token to share
    )
    if release is not None:
        env["PYTHONPATH"] = str(release)
    after = ",".join(map(str, SNAPSHOT_AFTER))
    command = [sys.executable, str(TRAINER), run_id, str(root), str(STEPS), after, str(out)]
    with log.open("wb") as sink:
        # A session of its own: its Ray (the cluster it started) is stopped with it, by group.
        return subprocess.Popen(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )


def ray_address_of(trainer: subprocess.Popen[bytes], log: Path, timeout_s: float = 120) -> str:
    """The GCS address the trainer prints once its controller actor runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("ray "):
                return line.removeprefix("ray ").strip()
        if trainer.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(
                f"trainer not started ({trainer.poll()}): {log.read_text()[-3000:]}"
            )
        time.sleep(0.1)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Every process a test starts, ended by pid (a trainer with its whole group: its Ray)."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in reversed(started):
        stop_process(proc, grace_s=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what its Ray left behind in its session


@pytest.mark.parametrize(
    ("trainer_release", "first", "then"),
    [("previous", "previous", "this"), ("this", "this", "previous")],
    ids=["upgrade", "rollback"],
)
def test_a_run_of_two_releases_rolls_its_workers_mid_snapshot(
    server: DevServer,
    tmp_path: Path,
    previous: Path,
    processes: list[subprocess.Popen[bytes]],
    trainer_release: str,
    first: str,
    then: str,
) -> None:
    release = {"previous": previous, "this": None}
    run_id = f"mixed-{uuid.uuid4().hex[:8]}"
    root, out = tmp_path / "snapshots", tmp_path / "trainer.json"
    trainer_log = tmp_path / "trainer.log"
    trainer = start_trainer(release[trainer_release], run_id, root, out, trainer_log, server)
    processes.append(trainer)
    address = ray_address_of(trainer, trainer_log)
    settings = server.settings()

    dying_log = tmp_path / f"worker-{first}.log"
    dying = worker_process(
        run_id, settings, address, dying_log, cwd=tmp_path, fault=DIES_AT, release=release[first]
    )
    processes.append(dying)
    wait_worker_ready(dying, dying_log, timeout_s=120)
    assert dying.wait(timeout=120) == EXIT_CODE, dying_log.read_text()[-3000:]  # mid-snapshot

    taking_log = tmp_path / f"worker-{then}.log"
    taking = worker_process(
        run_id, settings, address, taking_log, cwd=tmp_path, release=release[then]
    )
    processes.append(taking)
    wait_worker_ready(taking, taking_log, timeout_s=120)
    assert trainer.wait(timeout=180) == 0, trainer_log.read_text()[-3000:]

    report = json.loads(out.read_text())
    assert report["release"] == ("0.1.0" if trainer_release == "previous" else __version__)
    assert report["trained"] == list(range(STEPS))  # each group once, in order
    statuses = [(o["seq"], o["status"]) for o in report["outcomes"]]
    assert statuses == [(1, "published"), (2, "published")], report["outcomes"]
    published = SnapshotStore(root, run_id).list()  # this release reads what either wrote
    assert [e.state for e in published] == [EntryState.VALID, EntryState.VALID]
    log = taking_log.read_text(errors="replace")
    assert "Traceback" not in log and "VersionSkew" not in log, log[-3000:]
