"""The ``rollsafe`` command."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from rollsafe.dataplane import make_dataplane
from rollsafe.errors import InvalidInput, RollsafeError, RowMismatch

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="rollsafe: lossless RL rollout checkpoints"
)
scenario_app = typer.Typer(
    no_args_is_help=True, help="Replay scenario files against the real controller."
)
app.add_typer(scenario_app, name="scenario")


@scenario_app.command("run")
def scenario_run(
    file: Annotated[Path, typer.Argument(help="scenario JSON file (format in docs/scenarios.md)")],
    snapshot_dir: Annotated[
        Path | None,
        typer.Option(help="where snapshots are written (default: a temporary directory)"),
    ] = None,
    dataplane: Annotated[str, typer.Option(help="data-plane backend")] = "memory",
) -> None:
    """Apply FILE's events; print the resulting state as one JSON object.

    Exit 0: applied, every restored row matched. 1: a restored row differs (named).
    2: malformed file or impossible event.
    """
    from rollsafe.scenario import ScenarioRunner, load_scenario

    try:
        scenario = load_scenario(file)
        make_dataplane(dataplane)  # fail on an unknown backend before any event runs
        with tempfile.TemporaryDirectory(prefix="rollsafe-scenario-") as scratch:
            root = snapshot_dir if snapshot_dir is not None else Path(scratch)
            runner = ScenarioRunner(scenario, root, lambda: make_dataplane(dataplane))
            report = runner.run()
    except RowMismatch as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except (InvalidInput, RollsafeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    sys.stdout.write(report.model_dump_json() + "\n")


def main() -> None:  # pragma: no cover - console entry point
    app()
