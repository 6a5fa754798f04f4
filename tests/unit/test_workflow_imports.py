"""Workflow code imports only the stdlib, temporalio and models (docs/platform.md, Temporal).

The workflow sandbox re-imports a workflow's module, and every module it imports that is not
passed through, for every run and every replay; torch, numpy and ray fail its validation
outright. Two checks: importing the workflow modules in a fresh interpreter loads none of the
heavy packages (whatever the route, e.g. a package ``__init__`` on the way), and statically,
every import in ``workflows/*.py`` outside a ``workflow.unsafe.imports_passed_through()``
block is stdlib, temporalio, pydantic or ``__future__``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW_MODULES = (
    "rollsafe.workflows.snapshot",
    "rollsafe.workflows.supervisor",
    "rollsafe.workflows.restore",
    "rollsafe.workflows.models",
)
HEAVY = ("torch", "numpy", "ray", "transfer_queue", "transferqueue")
ALLOWED_OUTSIDE_PASSTHROUGH = frozenset({"__future__", "temporalio", "pydantic"})
WORKFLOW_FILES = sorted((ROOT / "workflows").glob("*.py"))


def import_chains(importtime_log: str, wanted: set[str]) -> dict[str, list[str]]:
    """From ``python -X importtime`` output: for each module in ``wanted``, the chain of
    imports that first loaded it (outermost first). Each line is printed when its import
    finishes, indented by nesting depth, so a module's importer is the next line below it
    with a smaller indent."""
    entries: list[tuple[int, str]] = []
    for line in importtime_log.splitlines():
        if not line.startswith("import time:") or line.rstrip().endswith("| package"):
            continue
        field = line.rsplit("|", 1)[1]
        name = field.strip()
        entries.append((len(field) - len(field.lstrip()), name))
    chains: dict[str, list[str]] = {}
    for i, (depth, name) in enumerate(entries):
        if name not in wanted or name in chains:
            continue
        chain = [name]
        for outer_depth, outer in entries[i + 1 :]:
            if outer_depth < depth:
                chain.append(outer)
                depth = outer_depth
        chains[name] = chain[::-1]
    return chains


def heavy_imports(modules: tuple[str, ...]) -> dict[str, list[str]]:
    """Import ``modules`` in a fresh interpreter: each heavy package that got loaded, with the
    chain of imports that loaded it."""
    code = (
        "import json, sys\n"
        + "".join(f"import {module}\n" for module in modules)
        + "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    loaded: list[str] = json.loads(done.stdout.splitlines()[-1])
    heavy = {name for name in loaded if name in HEAVY}
    chains = import_chains(done.stderr, heavy)
    return {name: chains.get(name, [f"{name} (chain not found)"]) for name in sorted(heavy)}


def test_importing_the_workflow_modules_loads_no_heavy_package() -> None:
    chains = heavy_imports(WORKFLOW_MODULES)
    assert not chains, f"importing {', '.join(WORKFLOW_MODULES)} loaded {sorted(chains)}:\n" + (
        "\n".join(" -> ".join(chain) for chain in chains.values())
    )


def test_the_import_check_names_the_chain() -> None:
    """The check above can fail: rollsafe.core.columns is numpy code."""
    assert heavy_imports(("rollsafe.core.columns",)) == {
        "numpy": ["rollsafe.core.columns", "numpy"]
    }


def _is_passthrough_block(node: ast.With | ast.AsyncWith) -> bool:
    for item in node.items:
        call = item.context_expr
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "imports_passed_through"
            and ast.unparse(call.func.value) in ("workflow.unsafe", "temporalio.workflow.unsafe")
        ):
            return True
    return False


def imports_outside_passthrough(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, top-level module, statement) of every import not inside a passthrough block
    (module level or nested in functions and classes alike). Relative imports count as
    first-party, never allowed."""
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.With | ast.AsyncWith) and _is_passthrough_block(node):
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name.split(".")[0], ast.unparse(node)) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            top = "." * node.level + (node.module or "").split(".")[0]
            found.append((node.lineno, top, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def allowed(top: str) -> bool:
    return top in ALLOWED_OUTSIDE_PASSTHROUGH or top in sys.stdlib_module_names


def test_the_static_check_sees_what_it_should() -> None:
    tree = ast.parse(
        "import os\n"
        "import numpy as np\n"
        "from . import models\n"
        "from temporalio import workflow\n"
        "with workflow.unsafe.imports_passed_through():\n"
        "    import ray\n"
        "    from rollsafe.core.phases import Phase\n"
        "with open('x') as f:\n"
        "    import torch\n"
        "def f():\n"
        "    from rollsafe import faults\n"
    )
    rejected = [top for _, top, _ in imports_outside_passthrough(tree) if not allowed(top)]
    assert rejected == ["numpy", ".", "torch", "rollsafe"]


def test_there_are_workflow_files_to_check() -> None:
    assert {path.name for path in WORKFLOW_FILES} >= {"snapshot.py", "supervisor.py", "models.py"}


@pytest.mark.parametrize("path", WORKFLOW_FILES, ids=[path.name for path in WORKFLOW_FILES])
def test_workflow_file_imports_only_sandbox_safe_modules_outside_passthrough(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {statement}"
        for line, top, statement in imports_outside_passthrough(tree)
        if not allowed(top)
    ]
    assert not bad, (
        "imports outside `with workflow.unsafe.imports_passed_through():` must be stdlib, "
        "temporalio, pydantic or __future__:\n" + "\n".join(bad)
    )
