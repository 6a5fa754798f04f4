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


def test_the_wheel_installs_only_the_rollsafe_namespace(tmp_path: Path) -> None:
    source = tracked_copy(tmp_path / "source")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*build, "-w", str(tmp_path), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("rollsafe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"rollsafe"}
    for folder in FOLDERS:
        sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*.py")}
        assert {f"rollsafe/{source}" for source in sources} <= set(names), folder
