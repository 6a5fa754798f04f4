"""Who may import what (docs/architecture.md, "Layout"), checked on the source, statically:

- the pure core (``rollsafe.core``) imports neither Temporal, Ray, nor any HTTP, object-storage
  or tensor library, and nothing of rollsafe outside the core but ``errors``, the data-plane
  protocol and the snapshot's bounded JSON (no snapshot file I/O);
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
    "rollsafe.dataplane",
    "rollsafe.snapshot.bounded",
)
# What of rollsafe outside the core each core module may import (the core itself aside), module
# by module: a new dependency of the core is a decision this list records.
ERRORS = frozenset({"rollsafe.errors"})
CORE_IMPORTS: dict[str, frozenset[str]] = {
    "__init__.py": frozenset(),
    "buffer/__init__.py": frozenset(),
    "buffer/index.py": ERRORS,
    "buffer/samplers.py": ERRORS,
    "capture.py": ERRORS,
    "columns.py": ERRORS,
    "config.py": frozenset(),
    "gate.py": ERRORS,
    "ids.py": ERRORS,
    "ledger.py": ERRORS | {"rollsafe.snapshot.bounded"},  # bounded JSON for its metadata
    "phases.py": frozenset(),
    # Rows through the data-plane protocol (the snapshot's files: rollsafe.snapshot.state_files).
    "run_state.py": ERRORS | {"rollsafe.dataplane"},
    "states.py": ERRORS,
    "wire.py": frozenset(),
}
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


def outside_imports(source: str) -> set[str]:
    """The modules of rollsafe outside the core that ``source`` imports."""
    return {
        module
        for _, module in imported(source)
        if module.split(".")[0] == "rollsafe" and not module.startswith("rollsafe.core")
    }


def test_each_core_module_imports_only_what_its_line_lists() -> None:
    listed = {str(path.relative_to(CORE)): outside_imports(path.read_text()) for path in CORE_FILES}
    assert set(listed) == set(CORE_IMPORTS), "a core module without its line (or a line too many)"
    for name, modules in listed.items():
        assert modules <= CORE_IMPORTS[name], f"{name}: {sorted(modules - CORE_IMPORTS[name])}"


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
