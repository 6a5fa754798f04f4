"""Shared test helpers (fixtures only: test modules are imported in importlib mode)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity, workflow

from rollsafe.dataplane import BACKENDS, DataPlane, make_dataplane
from rollsafe.observability.logs import LOGGERS
from rollsafe.snapshot import with_digest


@pytest.fixture(autouse=True)
def _restore_loggers() -> Iterator[None]:
    """configure_logging (every long-running command calls it) changes process-wide loggers:
    put them back after each test, so caplog keeps seeing rollsafe's records."""
    saved = [
        (logger, list(logger.handlers), logger.level, logger.propagate)
        for logger in map(logging.getLogger, LOGGERS)
    ]
    details = (workflow.logger.workflow_info_on_message, activity.logger.activity_info_on_message)
    yield
    for logger, handlers, level, propagate in saved:
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate
    workflow.logger.workflow_info_on_message, activity.logger.activity_info_on_message = details


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def resign_snapshot(snapshot: Path, relpath: str, mutate: Callable[[bytes], bytes]) -> None:
    """Change one file of a published snapshot and fix every digest that covers it, so the
    snapshot verifies but holds different content: the case only row digests can catch."""
    target = snapshot / relpath
    data = mutate(target.read_bytes())
    target.write_bytes(data)
    manifest = json.loads((snapshot / "manifest.json").read_text())
    if relpath.startswith("dataplane/"):
        inner = json.loads((snapshot / "dataplane.json").read_text())
        for entry in inner["files"]:
            if f"dataplane/{entry['path']}" == relpath:
                entry.update(sha256=_sha(data), bytes=len(data))
        encoded = json.dumps(inner).encode()
        (snapshot / "dataplane.json").write_bytes(encoded)
        manifest["files"]["dataplane.json"] = {"sha256": _sha(encoded), "bytes": len(encoded)}
    manifest["files"][relpath] = {"sha256": _sha(data), "bytes": len(data)}
    if "digest" in manifest:  # schema 2: its digest made to match the edit
        manifest = with_digest(manifest)
    (snapshot / "manifest.json").write_text(json.dumps(manifest))


def flip_first_int32(data: bytes) -> bytes:
    """Flip one bit in the first int32 data tensor of a safetensors file (a token of a row)."""
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    name = next(n for n, s in header.items() if n.endswith(".data") and s["dtype"] == "I32")
    at = 8 + header_len + header[name]["data_offsets"][0]
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root with its sha256: compare before/after to prove nothing changed."""
    return {
        str(path.relative_to(root)): _sha(path.read_bytes())
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.fixture
def resign() -> Callable[[Path, str, Callable[[bytes], bytes]], None]:
    return resign_snapshot


@pytest.fixture
def flip_a_token() -> Callable[[bytes], bytes]:
    return flip_first_int32


@pytest.fixture
def snapshot_tree() -> Callable[[Path], dict[str, str]]:
    return tree_digest


# -- Ray and TransferQueue: started on first use, once per session, stopped by the driver ---------


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """Shut down from the driver at the end (never killed by name). Settings as the
    TransferQueue runtime uses them (rollsafe.dataplane.tq_runtime)."""
    ray = pytest.importorskip("ray")
    from rollsafe.dataplane import tq_runtime

    wanted = {**tq_runtime.RAY_ENV, **tq_runtime.TQ_ENV}
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)  # before init, so every Ray process inherits them
    tq_runtime.start_local_ray()  # never a developer's `ray start` cluster
    try:
        yield ray
    finally:
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def transferqueue(ray_session: Any) -> Iterator[Any]:
    """One TransferQueue for the session (tq.init takes 6-8 s); tests keep apart by namespace."""
    from rollsafe.dataplane.tq_runtime import start_transferqueue

    runtime = start_transferqueue()
    try:
        yield runtime
    finally:
        runtime.close()


@pytest.fixture(params=BACKENDS)
def dataplane_factory(request: pytest.FixtureRequest) -> Iterator[Callable[[], DataPlane]]:
    """Makes fresh data planes of each backend in turn; clears them afterwards (a
    TransferQueue namespace outlives the plane object that wrote it)."""
    if request.param == "transferqueue":
        request.getfixturevalue("transferqueue")
    made: list[DataPlane] = []

    def make() -> DataPlane:
        plane = make_dataplane(request.param)
        made.append(plane)
        return plane

    yield make
    for plane in made:
        plane.clear()


@pytest.fixture(scope="session")
def tiny_models(request: pytest.FixtureRequest) -> dict[str, Path]:
    """The tiny Hugging Face models vLLM serves in tests, built once and cached on disk
    (pytest's cache directory): ``{"dense": dir, "moe": dir}``."""
    from rollsafe.engine.vllm.models import ModelSpec, make_model

    cache = request.config.cache
    assert cache is not None
    root = cache.mkdir("rollsafe-models")
    # Under xdist every worker builds them on first use: one at a time, the others reuse.
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return {arch: make_model(root / arch, ModelSpec(arch=arch)) for arch in ("dense", "moe")}


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A port bound and never listened on: a connect is refused, and nobody can take it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never says a word."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


# -- order: `make test` runs two workers (pytest-xdist), a module each at a time, in this order ---

# The longest module first, so that the other worker works through the short ones beside it
# instead of one worker finishing alone at the end; then the multi-node drill, the other
# worker's first module: it starts a Ray cluster of its own, which a process that joined
# another (the session's `ray_session`) cannot. Run without xdist, the order holds too.
FIRST = ("test_demo.py", "test_multinode.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: the rest keep their order
