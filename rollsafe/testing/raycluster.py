"""A Ray cluster of several nodes on one machine, for tests and drills (docs/deploy.md,
"Multi-node").

Each node is a ``ray start --block`` process started in a session of its own: the node's Ray
processes (GCS, raylet, agents, the workers the raylet forks) are that process's descendants
and members of its session, so a node is stopped, or killed as a machine dies, by exactly
those pids. Never by name: ``ray stop`` kills every Ray process of the machine's user.

Also small functions to run inside an actor with ``actor.__ray_call__.remote(fn, ...)``.
``rollsafe worker`` processes, on a node or not, are started by :mod:`rollsafe.testing.workers`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rollsafe.dataplane.tq_runtime import RAY_ENV, TQ_ENV

STARTED = "Ray runtime started."  # printed by `ray start` once its node runs
OBJECT_STORE_BYTES = 100 << 20  # per node; Ray's minimum is 75 MiB
# A node told to stop drains for up to 30 s (Ray's default): nothing here needs a drain.
GRACE_S = 5.0


@dataclass(frozen=True)
class NodeSpec:
    """One node: a name (logs, lookups), its logical CPUs and custom resources. Actors are
    placed on it by asking for a fraction of one of its custom resources."""

    name: str
    resources: Mapping[str, float]
    num_cpus: int = 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ray_cli() -> str:
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else "ray"


def _processes() -> dict[int, tuple[str, int, int]]:
    """pid -> (state, parent pid, session id) of every process, from /proc (Linux)."""
    table: dict[int, tuple[str, int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry)] = (fields[0], int(fields[1]), int(fields[3]))
    return table


def living(pids: Iterable[int]) -> set[int]:
    """Those of ``pids`` whose process exists and is not a zombie (one read of /proc)."""
    table = _processes()
    return {pid for pid in pids if pid in table and table[pid][0] != "Z"}


def alive(pid: int) -> bool:
    return bool(living([pid]))


@dataclass
class RayNode:
    spec: NodeSpec
    proc: subprocess.Popen[bytes]
    log_path: Path
    seen: set[int] = field(default_factory=set)  # every pid ever found in this node

    def pids(self) -> set[int]:
        """The node's live processes now: the ``ray start`` process, its descendants, and
        every process of its session (an orphan whose parent died first)."""
        table = _processes()
        leader = self.proc.pid
        found = {pid for pid, (_, _, session) in table.items() if session == leader}
        frontier = [leader] if leader in table else []
        while frontier:
            parent = frontier.pop()
            found.add(parent)
            frontier += [pid for pid, (_, ppid, _) in table.items() if ppid == parent]
        live = {pid for pid in found if table[pid][0] != "Z"}
        self.seen |= live
        return live

    def log(self, limit: int = 3000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"node {self.spec.name} (pid {self.proc.pid}): {text[-limit:]}"

    def kill(self, timeout_s: float = 30.0) -> set[int]:
        """SIGKILL every process of the node at once, as a machine that dies; returns them."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._wait_gone(pids, timeout_s)
        return pids

    def terminate(self) -> set[int]:
        """SIGTERM to every process of the node (a graceful stop); returns them."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        return pids

    def stop(self, grace_s: float = GRACE_S) -> None:
        """SIGTERM to the node's processes, SIGKILL whatever is left after ``grace_s``."""
        pids = self.terminate()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and living(pids) | self.pids():
            self.proc.poll()
            time.sleep(0.2)
        self.kill()

    def _wait_gone(self, pids: set[int], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)  # reap our own child, the `ray start` process
        while left := living(pids):
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {self.spec.name}: pids {sorted(left)} still alive")
            time.sleep(0.1)


class RayCluster:
    """A head and further nodes on this machine, each its own ``ray start --block`` process;
    started in order, stopped by pid (:meth:`stop`, also on a failed start). ``root`` holds
    the node logs; Ray's session files go to a short temporary directory (its socket paths
    must stay under 108 bytes), removed at :meth:`stop`: ``temp_dir``, or a new one.
    ``ray start`` also writes its address there (``ray_current_cluster``), where
    ``address="auto"`` looks for it when ``RAY_TMPDIR`` is that directory's parent and it is
    named ``ray``: a cluster every process of that environment joins by default, as a plain
    ``ray start``'s."""

    def __init__(
        self,
        root: Path,
        head: NodeSpec,
        nodes: Sequence[NodeSpec],
        *,
        object_store_bytes: int = OBJECT_STORE_BYTES,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 120.0,
        temp_dir: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.specs = [head, *nodes]
        self.object_store_bytes = object_store_bytes
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
        self.env = {**base, **RAY_ENV, **TQ_ENV, **(env or {})}
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.temp_dir = ""
        self._wanted_temp_dir = temp_dir
        self.nodes: dict[str, RayNode] = {}

    @property
    def address(self) -> str:
        """The GCS address: ``ray.init(address=...)``, ``rollsafe worker --ray-address``."""
        return f"127.0.0.1:{self.port}"

    def _command(self, spec: NodeSpec, head: bool) -> list[str]:
        command = [_ray_cli(), "start", "--block"]
        if head:
            command += ["--head", "--port", str(self.port), "--include-dashboard", "false"]
            command += ["--ray-client-server-port", str(free_port())]
        else:
            command += ["--address", self.address]
        command += ["--num-cpus", str(spec.num_cpus), "--num-gpus", "0"]
        command += ["--resources", json.dumps(dict(spec.resources))]
        command += ["--object-store-memory", str(self.object_store_bytes)]
        # Fixed default ports would collide between two nodes of one machine: any free ones.
        command += ["--dashboard-agent-listen-port", str(free_port())]
        command += ["--min-worker-port", "0", "--max-worker-port", "0"]
        command += ["--include-log-monitor", "false", "--disable-usage-stats"]
        command += ["--temp-dir", self.temp_dir]
        return command

    def _start_node(self, spec: NodeSpec, head: bool) -> RayNode:
        log_path = self.root / f"ray-{spec.name}.log"
        log: IO[bytes]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                self._command(spec, head),
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the node's processes share this session
            )
        node = RayNode(spec, proc, log_path)
        self.nodes[spec.name] = node
        deadline = time.monotonic() + self.start_timeout_s
        while STARTED not in log_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Ray node did not start: {node.log()}")
            time.sleep(0.1)
        node.pids()
        return node

    def start(self) -> RayCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        if self._wanted_temp_dir is None:
            self.temp_dir = tempfile.mkdtemp(prefix="rs-ray-", dir="/tmp")
        else:
            self.temp_dir = self._wanted_temp_dir
            os.makedirs(self.temp_dir, exist_ok=True)
        self.port = free_port()
        try:
            for n, spec in enumerate(self.specs):
                self._start_node(spec, head=n == 0)
        except BaseException:
            self.stop()
            raise
        return self

    def node(self, name: str) -> RayNode:
        return self.nodes[name]

    def seen_pids(self) -> set[int]:
        """Every process any node was seen with (call :meth:`RayNode.pids` to refresh)."""
        for node in self.nodes.values():
            if node.proc.poll() is None:
                node.pids()
        return set().union(*(node.seen for node in self.nodes.values()))

    def stop(self, grace_s: float = GRACE_S) -> None:
        """Stop every node at once: SIGTERM to all their processes, SIGKILL to what is left
        after ``grace_s``; idempotent. Raises if a process survives."""
        nodes = list(self.nodes.values())
        pids = set().union(*(node.terminate() for node in nodes))
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and living(pids) | self._pids():
            for node in nodes:
                node.proc.poll()
            time.sleep(0.2)
        errors = []
        for node in reversed(nodes):
            try:
                node.kill()
            except RuntimeError as exc:
                errors.append(str(exc))
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        if errors:
            raise RuntimeError("; ".join(errors))

    def _pids(self) -> set[int]:
        return set().union(*(node.pids() for node in self.nodes.values()))

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- inside the cluster: a Ray driver must be connected (ray.init) ---------------------------


def node_ids(timeout_s: float = 60.0, want: Sequence[str] = ()) -> dict[str, str]:
    """Custom resource name -> node id of the alive node that has it, waiting until every
    resource in ``want`` is on an alive node."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        found = {
            resource: node["NodeID"]
            for node in ray.nodes()  # type: ignore[no-untyped-call]
            if node["Alive"]
            for resource in node["Resources"]
        }
        if all(name in found for name in want):
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"resources {list(want)} not all on alive nodes: {found}")
        time.sleep(0.2)


def node_alive(node_id: str) -> bool:
    import ray

    nodes = ray.nodes()  # type: ignore[no-untyped-call]
    return any(node["NodeID"] == node_id and node["Alive"] for node in nodes)


def on(resource: str) -> dict[str, Any]:
    """Ray actor options placing an actor on the node with ``resource`` (a hundredth of it:
    several actors fit) and taking no CPU token."""
    return {"resources": {resource: 0.01}, "num_cpus": 0}


# Run inside an actor with `handle.__ray_call__.remote(fn, *args)` (fn gets the instance).


def where(_instance: Any) -> tuple[str, int]:
    """(Ray node id, pid) of the actor's process."""
    import ray

    return ray.get_runtime_context().get_node_id(), os.getpid()


def arm_fault(_instance: Any, name: str, action: str, times: int | None = None) -> None:
    """Arm a fault point in the actor's process (rollsafe.faults.arm), e.g. a slow phase
    that fires once."""
    from rollsafe.faults import arm

    arm(name, action, times)


def live_tokens(service: Any, pairs: Sequence[tuple[int, int]]) -> dict[tuple[int, int], Any]:
    """(group, index) -> the ``tokens`` of that sealed rollout, read from the data plane of a
    controller actor (Controller), wherever that data plane keeps its rows."""
    from rollsafe.core.run_state import ROLLOUT_PARTITION

    with service.barrier:
        keys = {pair: service.state.row_key(*pair) for pair in pairs}
        rows = service.state.dataplane.get(ROLLOUT_PARTITION, list(keys.values()))
    return {pair: rows[key]["tokens"] for pair, key in keys.items()}


def owned_groups(service: Any) -> list[int]:
    """The groups a controller actor (Controller) owns: handed out, not trained."""
    with service.barrier:
        return sorted(service.state.ledger.groups())
