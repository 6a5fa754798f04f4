"""The controller actor: :class:`~rollsafe.checkpoint.controller.Controller` as a Ray actor
named per run (docs/design.md section 4), started or found by the run's id.

Ray is imported only when an actor is started or looked up, so the run's pure code and the
unit tests never pay for it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollsafe.checkpoint.controller import Controller
from rollsafe.core.config import KEEP_LATEST_K, RunConfig
from rollsafe.core.ids import validate_run_id
from rollsafe.errors import ControllerUnavailable, InvalidInput

if TYPE_CHECKING:
    from ray.actor import ActorHandle

NAMESPACE = "rollsafe"
# Calls run on this many threads: a resume must not queue behind a long phase. The locks in
# Controller and the barrier make that safe.
MAX_CONCURRENCY = 8


def actor_name(run_id: str) -> str:
    return f"rollsafe-controller-{validate_run_id(run_id)}"


@functools.cache
def controller_actor_class() -> Any:
    import ray

    return ray.remote(Controller)


def start_controller_actor(  # noqa: PLR0913 (the actor's options, keyword-only)
    run_id: str,
    config: RunConfig,
    snapshot_root: Path | str,
    namespace: str = NAMESPACE,
    *,
    dataplane: str = "memory",
    keep_latest_k: int = KEEP_LATEST_K,
    runtime_env: dict[str, Any] | None = None,
    ray_options: Mapping[str, Any] | None = None,
    snapshot_cache: Path | str | None = None,
    start_over: bool = False,
) -> ActorHandle[Controller]:
    """The run's named controller actor, started if it is not running (get-if-exists: a
    second call gets the same actor and ignores its arguments). Not detached: it lives as
    long as the Ray job that started it. ``snapshot_root``: a path, or an object-storage URL
    (``s3://``, ``gs://``) whose drafts are staged under ``snapshot_cache``, a path on the
    nodes the actor may land on. ``ray_options``: further Ray actor options, e.g.
    where it runs (``{"resources": {"head_node": 0.01}}`` or a ``scheduling_strategy``);
    its name, namespace and get-if-exists are this function's own.

    If the run already has published snapshots, the new controller awaits its restore: it
    refuses work and snapshots (``AwaitingRestore``) until ``Checkpointer.restore`` has run,
    so a snapshot of its empty state can never displace the run's real one. ``start_over``:
    the run begins again from nothing instead (its old snapshots stay until retention)."""
    if config.run_id != run_id:
        raise InvalidInput(f"config is for run {config.run_id!r}, not {run_id!r}")
    reserved = sorted({"name", "namespace", "get_if_exists"} & set(ray_options or {}))
    if reserved:
        raise InvalidInput(f"ray_options may not set {', '.join(reserved)}")
    options: dict[str, Any] = {
        "name": actor_name(run_id),
        "namespace": namespace,
        "get_if_exists": True,
        "max_concurrency": MAX_CONCURRENCY,
        # Bookkeeping, not compute: it must schedule even when data-plane actors hold
        # every logical CPU (docs/platform.md).
        "num_cpus": 0,
    }
    if runtime_env is not None:
        options["runtime_env"] = runtime_env
    options.update(ray_options or {})
    cls = controller_actor_class()
    cache = None if snapshot_cache is None else str(snapshot_cache)
    handle: ActorHandle[Controller] = cls.options(**options).remote(
        config,
        str(snapshot_root),
        dataplane,
        keep_latest_k,
        snapshot_cache=cache,
        start_over=start_over,
    )
    handle.__ray_call__.remote(_configure_telemetry)  # the actor's process is ours to set up
    return handle


def _configure_telemetry(_: Controller) -> None:
    """Run inside the actor (``__ray_call__``): its process's telemetry, as the ``OTEL_*``
    variables of its runtime environment say (the controller itself never installs any)."""
    from rollsafe.observability.telemetry import configure_telemetry

    configure_telemetry()


def get_controller_actor(run_id: str, namespace: str = NAMESPACE) -> ActorHandle[Controller]:
    import ray

    name = actor_name(run_id)
    try:
        handle: ActorHandle[Controller] = ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise ControllerUnavailable(f"no actor {name!r} in Ray namespace {namespace!r}") from None
    return handle
