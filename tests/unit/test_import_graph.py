"""Who may import what (docs/architecture.md, "Layout"), checked on the source, statically:

- the pure core (``rollsafe.core``) imports neither Temporal, Ray, nor any HTTP, object-storage
  or tensor library, and nothing of rollsafe outside the core but ``errors``, ``faults``, the
  data-plane protocol and the snapshot format;
- nothing imports the top-level folders by their generic names (``workflows``, ``activities``,
  ``workers``, ``reference``): they are installed, and imported, as ``rollsafe.*`` only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "rollsafe" / "core"
CORE_FILES = sorted(CORE.rglob("*.py"))
FORBIDDEN_IN_CORE = ("temporalio", "ray", "httpx", "uvicorn", "starlette", "fsspec", "torch")
CORE_MAY_IMPORT = (
    "rollsafe.core",
    "rollsafe.errors",
    "rollsafe.faults",
    "rollsafe.dataplane",
    "rollsafe.snapshot",
)
GENERIC = ("workflows", "activities", "workers", "reference")
LINKED = tuple(ROOT / "rollsafe" / name for name in GENERIC)  # the links to the folders
SOURCES = ("rollsafe", *GENERIC, "tests", "bench", "infra")


def imported(source: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``source``, wherever it stands; for
    ``from rollsafe import x`` the module is ``rollsafe.x``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "rollsafe":
                found.extend((node.lineno, f"rollsafe.{alias.name}") for alias in node.names)
            else:
                found.append((node.lineno, node.module))
    return found


def core_violations(source: str) -> list[str]:
    """Each import the core may not make, as ``line: module``."""
    return [
        f"{line}: {module}"
        for line, module in imported(source)
        if module.split(".")[0] in FORBIDDEN_IN_CORE
        or (
            module.split(".")[0] == "rollsafe"
            and not any(module == ok or module.startswith(ok + ".") for ok in CORE_MAY_IMPORT)
        )
    ]


def test_there_is_a_core_to_check() -> None:
    assert {"ledger", "run_state", "gate", "ids", "phases"} <= {p.stem for p in CORE_FILES}


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(CORE)))
def test_the_core_imports_no_io_library_and_no_outer_layer(path: Path) -> None:
    assert not core_violations(path.read_text())


def test_the_core_check_can_fail() -> None:
    source = (
        "import ray\nfrom httpx import AsyncClient\nfrom rollsafe.checkpoint import controller\n"
        "from rollsafe import errors\nfrom rollsafe import client\nimport numpy\n"
    )
    assert core_violations(source) == [
        "1: ray",
        "2: httpx",
        "3: rollsafe.checkpoint",
        "5: rollsafe.client",
    ]


def test_nothing_imports_the_generic_top_level_names() -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for folder in SOURCES
        for path in sorted((ROOT / folder).rglob("*.py"))
        if not any(path.is_relative_to(link) for link in LINKED)
        for line, module in imported(path.read_text())
        if module.split(".")[0] in GENERIC
    ]
    assert not bad, "import these as rollsafe.<name>:\n" + "\n".join(bad)
