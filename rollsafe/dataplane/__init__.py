"""Data plane: where rollout rows live (docs/design.md section 9)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import get_args

from rollsafe.core.config import DataplaneName
from rollsafe.dataplane.protocol import DataPlane, Row, row_digest

__all__ = ["BACKENDS", "DataPlane", "Row", "backend_running", "make_dataplane", "row_digest"]

BACKENDS: tuple[str, ...] = get_args(DataplaneName)


def check_backend(name: str) -> str:
    from rollsafe.errors import InvalidInput

    if name not in BACKENDS:
        raise InvalidInput(f"unknown data plane {name!r} (available: {', '.join(BACKENDS)})")
    return name


def make_dataplane(name: str) -> DataPlane:
    """A fresh, empty data plane of the named backend. ``transferqueue`` attaches to the
    TransferQueue running in this process's Ray cluster (a new namespace of it)."""
    if check_backend(name) == "transferqueue":
        from rollsafe.dataplane.transferqueue import TransferQueueDataPlane

        return TransferQueueDataPlane()
    from rollsafe.dataplane.memory import MemoryDataPlane

    return MemoryDataPlane()


@contextmanager
def backend_running(name: str) -> Iterator[Callable[[], DataPlane]]:
    """Fresh planes of backend ``name`` on demand, with what the backend needs running
    meanwhile: for ``transferqueue``, Ray (a local one, or ``RAY_ADDRESS``) and TransferQueue
    are attached to or started, and stopped at exit if started here. Every plane made is
    cleared at exit: a TransferQueue namespace outlives the object that wrote it."""
    check_backend(name)
    made: list[DataPlane] = []

    def make() -> DataPlane:
        made.append(make_dataplane(name))
        return made[-1]

    with ExitStack() as stack:
        if name == "transferqueue":
            from rollsafe.dataplane.tq_runtime import transferqueue_running

            stack.enter_context(transferqueue_running())
        try:
            yield make
        finally:
            for plane in made:
                plane.clear()
