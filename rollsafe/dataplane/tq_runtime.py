"""Start, find and stop TransferQueue 0.1.11 on Ray, with the settings docs/platform.md measured.

TransferQueue is one system per Ray cluster: a named controller actor plus storage-unit actors,
and one client per process (module globals inside ``transfer_queue``). Whoever starts it owns
it: ``tq.close()`` in any process kills the shared controller, so only the owner may call it
(:meth:`TransferQueueRuntime.close` does so only when this process started it). Every other
process attaches (:func:`attach`). Ray and TransferQueue are imported on first use, so the pure
code and the memory backend never pay for them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from rollsafe.errors import DataPlaneUnavailable

CONTROLLER_NAME = "TransferQueueController"
CONTROLLER_NAMESPACE = "transfer_queue"
# Read by transfer_queue at import time, in this process and in its Ray workers (which inherit
# the environment ray.init sees). 8 threads (its default) fight over 2 cores.
TQ_ENV = {"TQ_NUM_THREADS": "2"}
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
# Logical CPUs are scheduling tokens: 4 leaves room beside TransferQueue's actors, which would
# take every token of a 2-CPU ray.init and starve any further default actor (docs/platform.md).
LOCAL_RAY_CPUS = 4
LOCAL_OBJECT_STORE_BYTES = 128 << 20

_lock = threading.Lock()


def export_ray_env() -> None:
    """The settings above into this process's environment, before ``ray.init``: every Ray
    process it starts inherits them."""
    for name, value in {**RAY_ENV, **TQ_ENV}.items():
        os.environ.setdefault(name, value)


def start_local_ray(**init: Any) -> None:
    """Start a Ray cluster of this process's own (``address="local"``), with the settings above
    in its environment. Never ``ray.init()`` without an address here: that joins the cluster of
    the machine's last ``ray start`` (or ``RAY_ADDRESS``), another user's or release's on a
    shared host (docs/deploy.md, "Which Ray cluster"). ``init``: further ``ray.init`` keywords
    (``namespace``, ``log_to_driver``)."""
    import ray

    export_ray_env()
    ray.init(
        address="local",
        num_cpus=LOCAL_RAY_CPUS,
        include_dashboard=False,
        object_store_memory=LOCAL_OBJECT_STORE_BYTES,
        **init,
    )


def tq_config(storage_units: int = 1, storage_resource: str | None = None) -> dict[str, Any]:
    """The default config hangs tq.init under a small ray.init; polling mode and one storage
    unit do not (docs/platform.md). ``storage_resource``: a Ray custom resource; the storage units
    (where the rows live) are then pinned, round robin, to the alive nodes that have it."""
    if storage_units < 1:
        raise ValueError(f"storage_units must be at least 1, got {storage_units}")
    simple: dict[str, Any] = {"num_data_storage_units": storage_units}
    if storage_resource is not None:
        simple["required_node_resource"] = storage_resource
    return {"controller": {"polling_mode": True}, "backend": {"SimpleStorage": simple}}


def nodes_with(resource: str) -> list[str]:
    """Ids of the alive Ray nodes that have some of ``resource``."""
    import ray

    return sorted(
        node["NodeID"]
        for node in ray.nodes()  # type: ignore[no-untyped-call]
        if node["Alive"] and node["Resources"].get(resource, 0) > 0
    )


def check_storage_resource(resource: str | None) -> None:
    """Before tq.init: it creates its named controller before it places the storage units,
    so a failed placement would leave a controller that every later attach finds."""
    if resource is not None and not nodes_with(resource):
        raise DataPlaneUnavailable(
            f"no alive Ray node has the custom resource {resource!r} for TransferQueue's "
            f"storage units: start the data-plane nodes with --resources "
            f"'{{\"{resource}\": 1}}', or pass no storage resource"
        )


def storage_unit_nodes(storage_units: int = 1) -> dict[str, str]:
    """Storage unit name -> the Ray node id it runs on; the units are named actors in the
    namespace of the process that started TransferQueue (so ask from there, or one sharing it)."""
    import ray

    placed: dict[str, str] = {}
    for rank in range(storage_units):
        name = f"TransferQueueStorageUnit#{rank}"
        ref: Any = ray.get_actor(name).__ray_call__.remote(_node_id)
        placed[name] = str(ray.get(ref))
    return placed


def controller_node() -> str:
    """The Ray node id TransferQueue's controller (its metadata) runs on."""
    import ray

    handle = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    ref: Any = handle.__ray_call__.remote(_node_id)
    return str(ray.get(ref))


def _node_id(_instance: Any) -> str:
    import ray

    node: str = ray.get_runtime_context().get_node_id()
    return node


def import_tq() -> ModuleType:
    for name, value in TQ_ENV.items():
        os.environ.setdefault(name, value)
    import transfer_queue

    module: ModuleType = transfer_queue
    return module


def controller_running() -> bool:
    import ray

    if not ray.is_initialized():
        return False
    try:
        ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        return False
    return True


def attach() -> Any:
    """This process's TransferQueue client, attached to the cluster's running system."""
    import ray

    if not ray.is_initialized():
        raise DataPlaneUnavailable(
            "the transferqueue data plane needs Ray in this process: call ray.init(address=...) "
            "or run inside rollsafe.dataplane.tq_runtime.transferqueue_running()"
        )
    if not controller_running():
        raise DataPlaneUnavailable(
            f"no TransferQueue controller ({CONTROLLER_NAMESPACE}/{CONTROLLER_NAME}) in this Ray "
            "cluster: start one with start_transferqueue() or transferqueue_running()"
        )
    tq = import_tq()
    with _lock:
        tq.init()  # attaches to the running controller; never starts a second one
        return tq.get_client()


class TransferQueueRuntime:
    """What :func:`start_transferqueue` started in this process, to be stopped by it alone."""

    def __init__(self, *, started_ray: bool, started_tq: bool) -> None:
        self.started_ray = started_ray
        self.started_tq = started_tq
        self._closed = False

    def close(self) -> None:
        """Stop what this process started (TransferQueue first, then Ray); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.started_tq:
                import_tq().close()
        finally:
            if self.started_ray:
                import ray

                ray.shutdown()


def start_transferqueue(
    *,
    ray_address: str | None = None,
    storage_units: int = 1,
    storage_resource: str | None = None,
) -> TransferQueueRuntime:
    """Make TransferQueue reachable from this process: connect to Ray at ``ray_address`` (or
    ``RAY_ADDRESS``; a local Ray is started when neither is set), then attach to the cluster's
    TransferQueue or start it, its storage units on the nodes with ``storage_resource`` when
    given (:func:`tq_config`; ignored when attaching). Takes 6-8 s when it starts TransferQueue."""
    import ray

    ray_address = ray_address or os.environ.get("RAY_ADDRESS") or None
    started_ray = False
    if not ray.is_initialized():
        if ray_address is None:
            start_local_ray()
        else:
            export_ray_env()
            ray.init(address=ray_address)
        started_ray = True
    try:
        with _lock:
            if controller_running():
                started_tq = False
                import_tq().init()
            else:
                check_storage_resource(storage_resource)
                started_tq = True
                import_tq().init(tq_config(storage_units, storage_resource))
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    return TransferQueueRuntime(started_ray=started_ray, started_tq=started_tq)


@contextmanager
def transferqueue_running(
    *,
    ray_address: str | None = None,
    storage_units: int = 1,
    storage_resource: str | None = None,
) -> Iterator[TransferQueueRuntime]:
    runtime = start_transferqueue(
        ray_address=ray_address, storage_units=storage_units, storage_resource=storage_resource
    )
    try:
        yield runtime
    finally:
        runtime.close()
