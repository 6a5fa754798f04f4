"""The ``rollsafe`` command."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from rollsafe.cli.doctor import register_doctor_command
from rollsafe.cli.engine import register_engine_commands
from rollsafe.cli.env import register_env_commands
from rollsafe.cli.run import register_run_commands
from rollsafe.cli.server import server_command
from rollsafe.dataplane import backend_running
from rollsafe.errors import RollsafeError, RowMismatch


def _fail(error: Exception, code: int) -> NoReturn:
    """One line on stderr naming the problem, and the command's exit code."""
    typer.echo(f"error: {error}", err=True)
    raise typer.Exit(code) from None


app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="rollsafe: lossless RL rollout checkpoints"
)
scenario_app = typer.Typer(
    no_args_is_help=True, help="Replay scenario files against the real controller."
)
app.add_typer(scenario_app, name="scenario")
snapshot_app = typer.Typer(
    no_args_is_help=True, help="Inspect a run's snapshots (a directory or object storage)."
)
app.add_typer(snapshot_app, name="snapshots")


@scenario_app.command("run")
def scenario_run(
    file: Annotated[Path, typer.Argument(help="scenario JSON file (format in docs/scenarios.md)")],
    snapshot_dir: Annotated[
        Path | None,
        typer.Option(help="where snapshots are written (default: a temporary directory)"),
    ] = None,
    dataplane: Annotated[
        str,
        typer.Option(
            help="data-plane backend: memory, or transferqueue (starts a local Ray and "
            "TransferQueue, or joins the cluster at RAY_ADDRESS)"
        ),
    ] = "memory",
) -> None:
    """Apply FILE's events; print the resulting state as one JSON object.

    Exit 0: applied, every restored row matched. 1: a restored row differs (named).
    2: malformed file or impossible event.
    """
    from rollsafe.evidence.scenario import ScenarioRunner, load_scenario

    try:
        scenario = load_scenario(file)
        with (
            backend_running(dataplane) as planes,
            tempfile.TemporaryDirectory(prefix="rollsafe-scenario-") as scratch,
        ):
            root = snapshot_dir if snapshot_dir is not None else Path(scratch)
            report = ScenarioRunner(scenario, root, planes).run()
    except RowMismatch as exc:
        _fail(exc, 1)
    except RollsafeError as exc:
        _fail(exc, 2)
    sys.stdout.write(report.model_dump_json() + "\n")


SNAPSHOT_ROOT_HELP = (
    "snapshot root: a directory (holds <run_id>/snapshots/) or object storage "
    "(s3://bucket/prefix, gs://bucket/prefix; file:// is a directory)"
)


@snapshot_app.command("list")
def snapshots_list(
    root: Annotated[str, typer.Argument(help=SNAPSHOT_ROOT_HELP)],
    run: Annotated[str, typer.Option("--run", help="run id")],
    verify: Annotated[bool, typer.Option(help="hash every file of every snapshot")] = True,
) -> None:
    """Every snapshot of RUN, newest first, with its state and why it would not be restored.
    On object storage each one is downloaded to a temporary directory to be verified (and
    nothing is written to the bucket). Exit 0 when at least one snapshot verifies, 1 when
    none does, 2 when the root cannot be read."""
    from rich.console import Console
    from rich.table import Table

    from rollsafe.snapshot import EntryState
    from rollsafe.snapshot.location import open_snapshot_store

    try:
        with tempfile.TemporaryDirectory(prefix="rollsafe-snapshots-") as cache:
            store = open_snapshot_store(root, run, cache_dir=cache)
            entries = store.list(verify=verify)
    except RollsafeError as exc:
        _fail(exc, 2)
    table = Table("snapshot", "state", "checkpoint", "weight", "loader", "files", "reason")
    for entry in entries:
        manifest = entry.manifest
        table.add_row(
            entry.name,
            entry.state.value,
            manifest.checkpoint_id if manifest else "",
            str(manifest.weight_version) if manifest else "",
            str(manifest.loader_position) if manifest else "",
            str(len(manifest.files)) if manifest else "",
            entry.reason or "",
        )
    Console(width=160).print(table)
    if verify and not any(entry.state == EntryState.VALID for entry in entries):
        typer.echo(f"no snapshot of run {run!r} under {root} verifies", err=True)
        raise typer.Exit(1)


app.command("server")(server_command)


@app.command("worker")
def worker_command(
    run: Annotated[
        str,
        typer.Option(
            "--run", envvar="ROLLSAFE_RUN_ID", help="run id whose snapshots this worker serves"
        ),
    ],
    task_queue: Annotated[
        str | None, typer.Option(help="Temporal task queue (default: rollsafe.<run>)")
    ] = None,
    ray_address: Annotated[
        str | None, typer.Option(help="Ray cluster address (default: RAY_ADDRESS or local)")
    ] = None,
    health_port: Annotated[
        int | None,
        typer.Option(
            envvar="ROLLSAFE_HEALTH_PORT",
            min=0,
            max=65535,
            help="serve GET /healthz (200 while polling, 503 starting or draining) and "
            "/livez on this port (0: any free one, printed; default: no probes)",
        ),
    ] = None,
    health_host: Annotated[
        str, typer.Option(envvar="ROLLSAFE_HEALTH_HOST", help="address the probes listen on")
    ] = "0.0.0.0",
    drain_timeout: Annotated[
        float,
        typer.Option(
            envvar="ROLLSAFE_DRAIN_TIMEOUT",
            min=0.0,
            help="seconds activities in flight may finish after SIGTERM before they are "
            "cancelled and retried elsewhere (0: cancel at once)",
        ),
    ] = 0.0,
) -> None:
    """Start a checkpoint worker. Connects to Temporal the standard way (TEMPORAL_ADDRESS,
    TEMPORAL_NAMESPACE, TLS and API-key variables, or a temporal config profile). SIGTERM or
    SIGINT drains it: it stops polling, lets activities in flight finish for up to
    --drain-timeout seconds, and exits 0."""
    import asyncio

    from rollsafe.workers.checkpoint import run_worker

    try:
        asyncio.run(
            run_worker(
                run,
                task_queue,
                ray_address=ray_address,
                health_port=health_port,
                health_host=health_host,
                drain_timeout_s=drain_timeout,
            )
        )
    except RollsafeError as exc:
        _fail(exc, 2)


@app.command("inspect")
def inspect_command(
    run: Annotated[str, typer.Argument(help="run id")],
    as_json: Annotated[bool, typer.Option("--json", help="print the view as JSON")] = False,
) -> None:
    """The run's checkpointing at a glance: supervisor state, the running snapshot's phase and
    for how long, the pending activity's attempt and last failure. Works with no worker alive
    (built from describe and search attributes)."""
    import asyncio

    from rollsafe.cli.inspection import inspect_run, render
    from rollsafe.temporal.connect import connect

    async def view() -> str:
        result = await inspect_run(await connect(), run)
        return result.model_dump_json(indent=2) if as_json else render(result)

    try:
        typer.echo(asyncio.run(view()))
    except RollsafeError as exc:
        _fail(exc, 2)


@app.command("ls")
def ls_command(
    run: Annotated[str, typer.Argument(help="run id")],
    root: Annotated[str, typer.Option(envvar="ROLLSAFE_SNAPSHOT_ROOT", help=SNAPSHOT_ROOT_HELP)],
) -> None:
    """The run's snapshots, each verified (same as `rollsafe snapshots list`)."""
    snapshots_list(root, run)


register_engine_commands(app, _fail)
register_env_commands(app, _fail)
register_run_commands(app, _fail)
register_doctor_command(app)


def main() -> None:  # pragma: no cover - console entry point
    app()
