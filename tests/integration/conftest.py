"""A real Ray for the integration tests: one local instance per session (PLATFORM.md, Ray)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="session")
def ray_session() -> Iterator[object]:
    """Started on first use, shut down from the driver at the end (never killed by name).
    Logical CPUs are scheduling tokens: 4 leaves room beside data-plane actors."""
    ray = pytest.importorskip("ray")
    saved = {name: os.environ.get(name) for name in RAY_ENV}
    os.environ.update(RAY_ENV)  # before init, so every Ray process inherits them
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=128 << 20)
    try:
        yield ray
    finally:
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
