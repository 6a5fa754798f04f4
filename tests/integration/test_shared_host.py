"""A host where someone else's Ray cluster runs (a plain ``ray start``, which every
``address="auto"`` and every address-less ``ray.init()`` of the machine joins): rollsafe's own
local Ray starts a cluster of its own beside it, and ``doctor`` names both clusters for a worker
left on ``auto``.

The other cluster is started the way ``ray start`` does by default, with the default temp dir
moved under this test's (``RAY_TMPDIR``) so that nothing outside the test can see it or be seen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollsafe.testing.raycluster import NodeSpec, RayCluster

pytestmark = pytest.mark.timeout(180)

CHILD = """
import json, ray
from rollsafe.cli.doctor.checks import check_ray
from rollsafe.dataplane.tq_runtime import start_local_ray
start_local_ray(log_to_driver=False)
own = ray.get_runtime_context().gcs_address
ray.get(ray.remote(lambda: 1).remote())  # the cluster it started does run work
auto = check_ray("auto", 5.0, count_nodes=False)
print(json.dumps({"own": own, "auto": auto.status.value, "detail": auto.detail}))
ray.shutdown()
"""


@pytest.fixture
def default_temp() -> Iterator[str]:
    # Ray's socket paths must stay under 108 bytes: a short directory, not pytest's tmp_path.
    with tempfile.TemporaryDirectory(prefix="rs-host-", dir="/tmp") as short:
        yield short


@pytest.fixture
def someone_elses_cluster(tmp_path: Path, default_temp: str) -> Iterator[RayCluster]:
    cluster = RayCluster(
        tmp_path / "other", NodeSpec("other", {"other": 1.0}), [], temp_dir=f"{default_temp}/ray"
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_rollsafe_starts_its_own_ray_beside_a_ray_start_cluster(
    someone_elses_cluster: RayCluster, default_temp: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = default_temp
    other = Path(default_temp, "ray", "ray_current_cluster").read_text().strip()
    # What an address-less ray.init would join (written with the node's IP, not 127.0.0.1).
    assert other.endswith(f":{someone_elses_cluster.port}")
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["own"] != other
    assert report["auto"] == "ok"
    assert f"'auto' joins {other} but" in report["detail"]
    assert report["own"] in report["detail"]
