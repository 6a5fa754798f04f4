"""The public API: ``rollsafe.__all__`` names what a user imports, each resolves to the object
its module defines, and ``import rollsafe`` alone loads none of the heavy libraries."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import rollsafe

HEAVY = ("temporalio", "ray", "httpx", "torch", "numpy", "vllm", "uvicorn")


@pytest.mark.parametrize("name", sorted(set(rollsafe.__all__) - {"__version__"}))
def test_every_public_name_resolves(name: str) -> None:
    assert getattr(rollsafe, name) is not None


def test_the_public_names_are_the_ones_documented() -> None:
    doc = rollsafe.__doc__ or ""
    undocumented = [
        name for name in rollsafe.__all__ if name != "__version__" and f"`{name}`" not in doc
    ]
    assert not undocumented


def test_every_public_name_has_a_home() -> None:
    assert set(rollsafe.__all__) == {"__version__", "errors", *rollsafe._WHERE}


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        rollsafe.Nope  # noqa: B018 - the attribute access is the test


def test_importing_rollsafe_loads_no_heavy_library() -> None:
    code = "import json, sys, rollsafe; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = {name.split(".")[0] for name in json.loads(done.stdout)}
    assert not loaded & set(HEAVY)
