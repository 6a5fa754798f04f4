"""Serving hooks of one's own (rollsafe.env.serve, ``rollsafe env serve --hooks``): the factory
spec refused by name when it cannot work, the flags checked before anything starts, and the
docs' example environment being the file ``make test`` runs env-check against."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollsafe.cli.app import app
from rollsafe.env.serve import ServeContext, hooks_options, load_hooks_factory, make_hooks
from rollsafe.errors import InvalidInput
from rollsafe.reference.envs.frozen_lake import FrozenLake

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("rollsafe.reference.envs.frozen_lake", "expected package.module:factory"),
        (":FrozenLake", "expected package.module:factory"),
        ("no_such_module_here:Env", "cannot import 'no_such_module_here'"),
        ("rollsafe.reference.envs.frozen_lake:Nope", "has no callable 'Nope'"),
        ("rollsafe.reference.envs.frozen_lake:MIN_TURNS_NOT_HERE", "has no callable"),
    ],
)
def test_a_hooks_spec_that_cannot_work_is_refused_by_name(spec: str, message: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(message)):
        load_hooks_factory(spec)


def test_a_module_in_the_current_directory_needs_no_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "beside_me_env.py").write_text("def make(context):\n    return context\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    factory = load_hooks_factory("beside_me_env:make")
    made: object = factory(ServeContext(engine=None))  # this factory returns its context
    assert made == ServeContext(engine=None)


def test_a_factory_must_return_hooks() -> None:
    with pytest.raises(InvalidInput, match="returned dict, not an EnvironmentHooks"):
        make_hooks(lambda context: {}, ServeContext(engine=None))  # type: ignore[arg-type,return-value]
    with pytest.raises(InvalidInput, match="needs --engine-url"):
        make_hooks(FrozenLake, ServeContext(engine=None))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give an environment NAME or --hooks"),
        (["workplace", "--hooks", "a.b:C"], "not both"),
        (["nowhere"], "no environment 'nowhere'"),
        (["workplace"], "workplace needs --engine-url"),
        (["--hooks", "a.b:C", "--engine-url", "http://x"], "go together"),
        (["--hooks", "no_such_module_here:Env"], "cannot import"),
        (["workplace", "--snapshot-root", "s3://bucket/runs"], "a local directory"),
    ],
)
def test_env_serve_refuses_bad_flags_before_serving(args: list[str], message: str) -> None:
    args = ["env", "serve", "--port", "0", *args]
    result = CliRunner().invoke(app, args, env={"ROLLSAFE_ENV_TOKEN": "t"})
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_the_docs_example_is_the_tested_file() -> None:
    """docs/environment-protocol.md shows reference/envs/frozen_lake.py whole: the file the
    conformance test serves and checks, so the page never drifts from what runs."""
    doc = (REPO / "docs" / "environment-protocol.md").read_text()
    source = (REPO / "reference" / "envs" / "frozen_lake.py").read_text()
    assert f"```python\n{source}```" in doc


def test_hooks_options_come_from_a_file_then_the_flags_over_it(tmp_path: Path) -> None:
    file = tmp_path / "options.json"
    file.write_text('{"ledger": "/a", "turn_s": "1"}')
    assert hooks_options(["turn_s=2", "empty="], file) == {
        "ledger": "/a",
        "turn_s": "2",
        "empty": "",
    }
    file.write_text('{"turn_s": 1}')
    with pytest.raises(InvalidInput, match="not a JSON object of strings"):
        hooks_options([], file)
    with pytest.raises(InvalidInput, match=r"options\.json\.missing"):
        hooks_options([], tmp_path / "options.json.missing")
