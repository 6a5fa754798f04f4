"""``rollsafe worker`` processes for tests and drills: started with a given Temporal and Ray,
waited for until they poll, stopped by pid; and :class:`WorkerLauncher`, a Ray actor that
starts one on the node it is placed on, so that the worker dies with that node
(:meth:`rollsafe.testing.raycluster.RayNode.kill`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rollsafe.dataplane.tq_runtime import RAY_ENV, TQ_ENV
from rollsafe.temporal.connect import ConnectionSettings

WORKER_BANNER = "rollsafe worker: run"  # printed once the worker polls its task queue


def worker_process(
    run_id: str,
    settings: ConnectionSettings,
    ray_address: str,
    log: Path,
    *,
    cwd: Path,
    new_session: bool = True,
    fault: str | None = None,
    release: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``rollsafe worker --run RUN_ID`` joining the Ray cluster at ``ray_address`` as a
    driver and Temporal at ``settings`` (address and namespace only: no TLS here), its output
    in ``log``, ``fault`` armed in it (``rollsafe.faults``). In a session of its own by
    default (a Ctrl-C meant for the caller does not reach it); ``new_session=False`` keeps it
    in the caller's, so that it dies with the node of a caller that is a Ray actor
    (:class:`WorkerLauncher`). ``release``: a directory holding another release's
    ``rollsafe`` package (an unpacked wheel), run instead of the installed one."""
    from rollsafe.children import PARENT_PID_ENV
    from rollsafe.faults import ENV_VAR

    # A Ray worker process's own RAY_* variables (its job, raylet, address) would mislead the
    # driver the worker starts; TEMPORAL_* from the caller would override the settings.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TEMPORAL_", "RAY_")) and k != ENV_VAR
    }
    env.update(
        {**RAY_ENV, **TQ_ENV},
        TEMPORAL_ADDRESS=settings.address,
        TEMPORAL_NAMESPACE=settings.namespace,
        TEMPORAL_CONFIG_FILE=str(log.parent / "no-temporal-config.toml"),
    )
    if fault is not None:
        env[ENV_VAR] = fault
    if release is not None:
        env["PYTHONPATH"] = str(release)  # ahead of the installed (editable) rollsafe
    env[PARENT_PID_ENV] = str(os.getpid())  # it ends with its caller (rollsafe.children)
    command = [sys.executable, "-m", "rollsafe", "worker", "--run", run_id]
    with log.open("wb") as out:
        return subprocess.Popen(
            [*command, "--ray-address", ray_address],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )


def wait_worker_ready(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Until the worker prints that it polls; raises with its log if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while WORKER_BANNER not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"worker {proc.pid} not ready (exit {proc.poll()}): {tail}")
        time.sleep(0.1)


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> int:
    """SIGTERM (a worker drains), SIGKILL after ``grace_s``; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


class WorkerLauncher:
    """Starts a ``rollsafe worker`` process on the node this Ray actor is placed on, as a
    machine's process supervisor would: a child of the actor's process in the node's
    session, so it dies with the node (:meth:`RayNode.kill`). Start it with
    ``ray.remote(WorkerLauncher).options(**on("node_b")).remote(run_id, settings, address,
    log, cwd)``; :meth:`ready` returns the worker's pid (its Temporal identity is
    ``pid@host``)."""

    def __init__(
        self, run_id: str, settings: ConnectionSettings, ray_address: str, log: str, cwd: str
    ) -> None:
        self.log = Path(log)
        self.proc = worker_process(
            run_id, settings, ray_address, self.log, cwd=Path(cwd), new_session=False
        )

    def ready(self, timeout_s: float = 60.0) -> int:
        wait_worker_ready(self.proc, self.log, timeout_s)
        return self.proc.pid

    def stop(self) -> int:
        return stop_process(self.proc)
