"""The ``rollsafe`` command.

Conventions every command follows: exit codes 0, 1, 2 as in :mod:`rollsafe.cli.exits`
(docs/operations.md, "Exit codes"); ``--json`` on each command that lists or reports puts one
JSON document on stdout and nothing else; a fixed set of values is a choice click checks;
tokens come from an environment variable or ``--token-file``; a failure is one line on stderr
naming what failed and the fix, never a traceback.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Annotated

import typer

from rollsafe.children import watch_parent
from rollsafe.cli.checkpointing import register_checkpointing_commands
from rollsafe.cli.config import register_config_commands
from rollsafe.cli.doctor import register_doctor_command
from rollsafe.cli.engine import register_engine_commands
from rollsafe.cli.env import register_env_commands
from rollsafe.cli.exits import EXIT_CODES, RAY_FIX, fail, run_command
from rollsafe.cli.gateway import register_gateway_commands
from rollsafe.cli.options import (
    JsonOption,
    LogFormatOption,
    LogLevelOption,
    RunArgument,
    start_logging,
)
from rollsafe.cli.run import register_run_commands
from rollsafe.cli.server import server_command
from rollsafe.cli.snapshots import register_snapshot_commands
from rollsafe.core.config import DataplaneName
from rollsafe.core.ids import validate_run_id
from rollsafe.dataplane import backend_running
from rollsafe.errors import RollsafeError
from rollsafe.versions import THIS
from rollsafe.workers.watchdog import EXIT_AFTER_S

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="rollsafe: lossless RL rollout checkpoints"
)
scenario_app = typer.Typer(
    no_args_is_help=True, help="Replay scenario files against the real controller."
)
app.add_typer(scenario_app, name="scenario")


def _print_version(asked: bool) -> None:
    """The release and its contract (the source's own: an editable install's metadata keeps
    the version it was installed at)."""
    if not asked:
        return
    typer.echo(f"rollsafe {THIS.release} (contract {THIS.contract}: docs/upgrading.md)")
    raise typer.Exit()


@app.callback()
def main_options(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    """Options before any command; the command's telemetry, as the OTEL_* variables say (a
    bad one is a usage error, named: typer leaves an error raised here uncaught)."""
    from rollsafe.observability.telemetry import configure_telemetry

    try:
        configure_telemetry()
    except RollsafeError as exc:
        fail(exc)


@scenario_app.command("run", epilog=EXIT_CODES)
def scenario_run(
    file: Annotated[
        Path,
        typer.Argument(dir_okay=False, help="scenario JSON file (format in docs/scenarios.md)"),
    ],
    snapshot_dir: Annotated[
        Path | None,
        typer.Option(help="where snapshots are written (default: a temporary directory)"),
    ] = None,
    dataplane: Annotated[
        DataplaneName,
        typer.Option(
            help="data-plane backend: memory, or transferqueue (starts a local Ray and "
            "TransferQueue, or joins the cluster at RAY_ADDRESS)"
        ),
    ] = "memory",
) -> None:
    """Apply FILE's events; print the resulting state as one JSON object. Fails (1) when a
    restored row differs (named); a malformed file or an impossible event is a usage error
    (2)."""
    from rollsafe.evidence.scenario import ScenarioRunner, load_scenario

    try:
        scenario = load_scenario(file)
        with (
            backend_running(dataplane) as planes,
            tempfile.TemporaryDirectory(prefix="rollsafe-scenario-") as scratch,
        ):
            root = snapshot_dir if snapshot_dir is not None else Path(scratch)
            report = ScenarioRunner(scenario, root, planes).run()
    except RollsafeError as exc:  # RowMismatch 1; ScenarioError (the file's fault) 2
        fail(exc)
    sys.stdout.write(report.model_dump_json() + "\n")


app.command("server", epilog=EXIT_CODES)(server_command)


RAY_CHECK_TIMEOUT_S = 5.0


def _ray_problem(ray_address: str | None) -> str | None:
    """Why the worker cannot join Ray, found in seconds (doctor's check: a TCP connect to the
    head) instead of after Ray's own minutes of retries; None when it may try."""
    from rollsafe.cli.doctor.checks import Status, check_ray

    address = ray_address or os.environ.get("RAY_ADDRESS") or "auto"  # as ray.init resolves it
    check = check_ray(address, RAY_CHECK_TIMEOUT_S, count_nodes=False)
    if check.status is not Status.FAILED:
        return None
    return f"{check.detail} (fix: {check.fix})"


def _ray_joined() -> bool:
    """Whether this process joined Ray. After a ConnectionError or RuntimeError out of the
    worker, False means joining Ray is what failed: the worker joins first, before anything
    else that raises them."""
    import ray

    return bool(ray.is_initialized())


def _ray_where(ray_address: str | None) -> str:
    return ray_address or os.environ.get("RAY_ADDRESS") or "this machine (address 'auto')"


def _ray_join_failure(error: BaseException, ray_address: str | None) -> str:
    """The worker's one line for Ray's own join error: the address, Ray's cause (never the
    traceback a Ray Client error carries from the server) and the fix for that kind of
    address (Ray Client's port and versions for ``ray://``)."""
    from rollsafe.cli.doctor.checks import parse_ray_address, ray_client_fix, ray_error_cause

    where = _ray_where(ray_address)
    fix = RAY_FIX
    if where.startswith("ray://"):  # parsed already: the pre-check refuses a bad address
        _scheme, host, port = parse_ray_address(where)
        fix = ray_client_fix(host, port)
    return f"cannot join Ray at {where}: {ray_error_cause(str(error))} (fix: {fix})"


@app.command("worker", epilog=EXIT_CODES)
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
    stuck_exit: Annotated[
        float,
        typer.Option(
            envvar="ROLLSAFE_STUCK_EXIT",
            min=0.0,
            help="seconds the worker's event loop or channel to Ray may stand still before "
            "the worker exits (70) for its supervisor to restart it; its probes say 'stuck' "
            "after 5 s (0: never exit)",
        ),
    ] = EXIT_AFTER_S,
    log_level: LogLevelOption = None,
    log_format: LogFormatOption = None,
) -> None:
    """Start a checkpoint worker. Connects to Temporal the standard way (TEMPORAL_ADDRESS,
    TEMPORAL_NAMESPACE, TLS and API-key variables, or a temporal config profile). SIGTERM or
    SIGINT drains it: it stops polling, lets activities in flight finish for up to
    --drain-timeout seconds, and exits 0."""
    import asyncio

    from rollsafe.faults import fault_point
    from rollsafe.workers.checkpoint import WORKER_EXIT, run_worker

    try:
        validate_run_id(run)  # before joining anything: a typo is not worth a wait
        start_logging(log_level, log_format)
    except RollsafeError as exc:
        fail(exc)
    if (problem := _ray_problem(ray_address)) is not None:
        fail(f"cannot join Ray: {problem}")
    # Ray Client's warning on a failed join repeats the error line's fix over two more lines.
    warnings.filterwarnings("ignore", "Ray Client connection timed out", UserWarning)
    try:
        asyncio.run(
            run_worker(
                run,
                task_queue,
                ray_address=ray_address,
                health_port=health_port,
                health_host=health_host,
                drain_timeout_s=drain_timeout,
                stuck_exit_s=stuck_exit,
            )
        )
        fault_point(WORKER_EXIT)
    except RollsafeError as exc:
        fail(exc)
    except (ConnectionError, RuntimeError) as exc:
        if _ray_joined():
            raise  # not Ray's join: a failure nobody anticipated keeps its traceback
        fail(_ray_join_failure(exc, ray_address))


@app.command("inspect", epilog=EXIT_CODES)
def inspect_command(
    run: RunArgument,
    as_json: JsonOption = False,
) -> None:
    """The run's checkpointing at a glance: supervisor state, the running snapshot's phase and
    for how long, the pending activity's attempt and last failure. Works with no worker alive
    (built from describe and search attributes). Exit 2 when the Temporal namespace knows no
    such run (no workflow of it, no worker of its task queue)."""
    from temporalio.client import Client

    from rollsafe.cli.checkpointing import against_temporal
    from rollsafe.cli.inspection import RunView, inspect_run, render

    try:
        validate_run_id(run)
    except RollsafeError as exc:
        fail(exc)

    async def view(client: Client) -> RunView:
        return await inspect_run(client, run)

    result = against_temporal(view)
    typer.echo(result.model_dump_json(indent=2) if as_json else render(result))


snapshot_app = register_snapshot_commands(app)
register_checkpointing_commands(app, snapshot_app)
register_engine_commands(app)
register_env_commands(app)
register_gateway_commands(app)
register_run_commands(app)
register_doctor_command(app)
register_config_commands(app)


def main() -> None:  # pragma: no cover - console entry point
    watch_parent()  # started by another rollsafe process: end with it (rollsafe.children)
    run_command(lambda: app(prog_name="rollsafe"))
