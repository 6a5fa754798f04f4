"""``rollsafe env serve`` and ``rollsafe env-check``: an environment's checkpoint protocol,
served and checked."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rollsafe.cli.exits import EXIT_CODES, ExitCode, fail, usage_error
from rollsafe.cli.options import (
    JsonOption,
    LogFormatOption,
    LogLevelOption,
    PortOption,
    start_logging,
)
from rollsafe.cli.tokens import (
    EngineToken,
    EngineTokenFile,
    EnvToken,
    EnvTokenFile,
    required_token,
    resolve_token,
)
from rollsafe.env.participant import LEASE_GRACE_S, TOOL_WAIT_S
from rollsafe.env.serve import (
    HooksFactory,
    ServeContext,
    hooks_options,
    load_hooks_factory,
    make_hooks,
    serve,
)
from rollsafe.errors import RollsafeError
from rollsafe.http.bearer import ENGINE_TOKEN_ENV, ENV_TOKEN_ENV

if TYPE_CHECKING:
    from rollsafe.env.conformance import ConformanceReport
    from rollsafe.env.hooks import EnvironmentHooks
    from rollsafe.reference.envs.workplace.faults import FaultSwitches

ENVIRONMENTS = ("workplace", "completion")


# The engine's token, named in the errors that ask for it.
ENGINE_TOKEN_WAYS = f"an engine token ({ENGINE_TOKEN_ENV} or --engine-token-file)"


def _engine_token(file: Path | None) -> str | None:
    return resolve_token(file, file_flag="--engine-token-file", envvar=ENGINE_TOKEN_ENV)


def _env_token(file: Path | None) -> str:
    return required_token(file, file_flag="--token-file", envvar=ENV_TOKEN_ENV)


def _environment_problem(name: str | None, hooks: str | None) -> str | None:
    """What is wrong with ``env serve``'s choice of environment, if anything."""
    if (name is None) == (hooks is None):
        return "give an environment NAME or --hooks module:factory, not both"
    if name is not None and name not in ENVIRONMENTS:
        return f"no environment {name!r}; known: {', '.join(ENVIRONMENTS)}"
    return None


def _engine_problem(
    name: str | None, engine_url: str | None, engine_token: str | None
) -> str | None:
    """What is wrong with ``env serve``'s policy engine flags, if anything."""
    if (engine_url is None) != (engine_token is None):
        return f"--engine-url and {ENGINE_TOKEN_WAYS} go together"
    if name is not None and engine_url is None:
        return f"{name} needs --engine-url and {ENGINE_TOKEN_WAYS}"
    return None


def register_env_commands(app: typer.Typer) -> None:
    """Add ``env serve`` and ``env-check`` to the ``rollsafe`` command."""
    env_cli = typer.Typer(
        no_args_is_help=True, help="Serve an environment's checkpoint protocol over HTTP."
    )
    app.add_typer(env_cli, name="env")
    env_cli.command("serve", epilog=EXIT_CODES)(env_serve)
    app.command("env-check", epilog=EXIT_CODES)(env_check)


def _episode_task(task: str | None) -> dict[str, Any] | None:
    """``--task`` parsed: a JSON object, or a usage error."""
    import json

    try:
        parsed = None if task is None else json.loads(task)
    except ValueError as exc:
        usage_error(f"--task is not JSON: {exc}")
    if parsed is not None and not isinstance(parsed, dict):
        usage_error("--task must be a JSON object")
    return parsed


def env_serve(
    port: PortOption,
    token_file: EnvTokenFile = None,
    token: EnvToken = None,
    name: Annotated[
        str | None,
        typer.Argument(help="a built-in environment: workplace or completion (or use --hooks)"),
    ] = None,
    hooks: Annotated[
        str | None,
        typer.Option(
            help="your own environment: package.module:factory, called with a "
            "rollsafe.env.serve.ServeContext, returning EnvironmentHooks"
        ),
    ] = None,
    hooks_option: Annotated[
        list[str] | None,
        typer.Option(
            help="KEY=VALUE for your hooks (ServeContext.options); repeat for more. Secrets "
            "belong in a file the hooks read, not here (argv is visible)",
        ),
    ] = None,
    hooks_options_file: Annotated[
        Path | None,
        typer.Option(help="a JSON object of strings: your hooks' options (under --hooks-option)"),
    ] = None,
    engine_url: Annotated[
        str | None,
        typer.Option(help="the policy engine, e.g. http://host:port (workplace needs one)"),
    ] = None,
    engine_token: EngineToken = None,
    engine_token_file: EngineTokenFile = None,
    instance: Annotated[
        str | None, typer.Option(help="instance name (default: <name>-<pid>)")
    ] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    lease_grace_s: Annotated[
        float, typer.Option(help="a checkpoint's lease runs this long past its deadline")
    ] = LEASE_GRACE_S,
    tool_wait_s: Annotated[
        float, typer.Option(help="how long a prepare waits for tool calls to end")
    ] = TOOL_WAIT_S,
    snapshot_root: Annotated[
        str | None,
        typer.Option(
            help="the local directory the run's snapshots are written under (with object "
            "storage: its cache_dir); commit and restore may name no path outside it",
        ),
    ] = None,
    faults: Annotated[
        str,
        typer.Option(
            envvar="ROLLSAFE_ENV_FAULTS",
            help="test fault switches, e.g. slow_prepare:2.0,unavailable,die_on:commit",
        ),
    ] = "",
    max_tokens: Annotated[
        int, typer.Option(min=1, help="workplace: tokens each policy call generates")
    ] = 12,
    log_level: LogLevelOption = None,
    log_format: LogFormatOption = None,
) -> None:
    """Serve an environment's checkpoint protocol and /episodes/run until SIGINT/SIGTERM: the
    built-in NAME, or your own hooks (--hooks). Prints one line, `rollsafe env serving <name>
    <instance> on http://host:port`, once listening. The bearer token clients must send:
    ROLLSAFE_ENV_TOKEN, or --token-file; the engine's: ROLLSAFE_ENGINE_TOKEN, or
    --engine-token-file."""
    import asyncio

    if (problem := _environment_problem(name, hooks)) is not None:
        usage_error(problem)
    if hooks is None and (hooks_option or hooks_options_file):
        usage_error("--hooks-option and --hooks-options-file are for --hooks")
    if snapshot_root is not None and "://" in snapshot_root:
        usage_error(f"--snapshot-root is a local directory, not {snapshot_root!r}")
    from rollsafe.reference.envs.workplace.faults import parse_faults

    try:
        secret = _env_token(token_file)
        engine_secret = _engine_token(engine_token_file)
        if (problem := _engine_problem(name, engine_url, engine_secret)) is not None:
            usage_error(problem)
        switches = parse_faults(faults)
        start_logging(log_level, log_format)
        served: dict[str, Any] = {
            "host": host,
            "port": port,
            "token": secret,
            "instance": instance,
            "lease_grace_s": lease_grace_s,
            "tool_wait_s": tool_wait_s,
            "snapshot_root": snapshot_root,
        }
        factory = _builtin(name, max_tokens) if hooks is None else load_hooks_factory(hooks)
        options = hooks_options(hooks_option or (), hooks_options_file)
        context = ServeContext(engine=None, instance=instance, options=options)
        asyncio.run(_serve_hooks(factory, context, engine_url, engine_secret, switches, served))
    except RollsafeError as exc:
        fail(exc)


def env_check(
    url: Annotated[str, typer.Argument(help="the instance, e.g. http://host:port")],
    token_file: EnvTokenFile = None,
    token: EnvToken = None,
    task: Annotated[
        str | None,
        typer.Option(
            help="an episode task as a JSON object, long enough to park mid-way (required: "
            "the restore checks run episodes)"
        ),
    ] = None,
    lease_wait_s: Annotated[
        float,
        typer.Option(
            min=0.0, help="wait this long past a deadline for the lease to run out (0: skip)"
        ),
    ] = 60.0,
    engine_url: Annotated[
        str | None,
        typer.Option(help="the instance's policy engine: a call is cut there and must resume"),
    ] = None,
    engine_token: EngineToken = None,
    engine_token_file: EngineTokenFile = None,
    snapshot_root: Annotated[
        Path | None,
        typer.Option(
            help="the instance's --snapshot-root, if it has one: the checks commit under it"
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Run the checkpoint protocol's conformance checks against the instance at URL.

    The instance must be idle, and may run other episodes meanwhile. One line per check (on
    stderr with --json, which prints the report). Fails (1) when a check fails (named) or
    the instance cannot be reached; exits 2 when a check could not run (named, with what to
    give), when the instance refuses the token (401), or without --task; exits 3 when every
    check passed but what decides a lossless restore could not be compared ("passed, not
    verified: effects, state": no effect through session.effect and no side_effects = False
    declared; no state_digest). The instance's token: ROLLSAFE_ENV_TOKEN, or --token-file; the
    engine's: ROLLSAFE_ENGINE_TOKEN, or --engine-token-file."""
    import asyncio

    from rollsafe.env.conformance import run_conformance

    if not url.startswith(("http://", "https://")):
        usage_error(f"{url!r} is not an instance URL: give http://host:port")
    episode_task = _episode_task(task)
    try:
        secret = _env_token(token_file)
        engine_secret = _engine_token(engine_token_file)
    except RollsafeError as exc:
        fail(exc)
    if (engine_url is None) != (engine_secret is None):
        usage_error(f"--engine-url and {ENGINE_TOKEN_WAYS} go together")
    if episode_task is None:
        usage_error(
            "--task is required: without an episode the restore, cut, abandoned-attempt and "
            "effect checks cannot run, and a check that did not run is not a pass"
        )
    try:
        report = asyncio.run(
            run_conformance(
                url,
                secret,
                task=episode_task,
                lease_wait_s=lease_wait_s,
                engine_url=engine_url,
                engine_token=engine_secret,
                snapshot_root=snapshot_root,
                progress=lambda line: typer.echo(line, err=as_json),
            )
        )
    except RollsafeError as exc:
        fail(exc)
    if as_json:
        typer.echo(report.model_dump_json(indent=2))
    else:
        typer.echo(_verdict(report))
    if any(not c.passed and not c.skipped for c in report.checks):
        raise typer.Exit(int(ExitCode.FAILURE))
    if report.skipped:
        raise typer.Exit(int(ExitCode.USAGE))
    if report.not_verified:
        raise typer.Exit(int(ExitCode.UNVERIFIED))


def _verdict(report: ConformanceReport) -> str:
    """The last line: failed and skipped checks by name; "all checks passed" only when each
    ran and passed and nothing that decides a lossless restore went unseen ("passed, not
    verified: effects, state" otherwise); then what could not be compared."""
    failed = [c.name for c in report.checks if not c.passed and not c.skipped]
    skipped = [f"{c.name} ({c.detail})" for c in report.skipped]
    parts = [f"FAILED: {', '.join(failed)}"] if failed else []
    parts += [f"NOT RUN: {'; '.join(skipped)}"] if skipped else []
    if not parts and report.not_verified:
        parts = [f"passed, not verified: {', '.join(report.not_verified)}"]
    verdict = "; ".join(parts) or "all checks passed"
    line = f"{report.url} ({report.instance}): {verdict} in {report.seconds:.1f}s"
    if report.not_compared:
        line += "\nnot compared: " + "; ".join(report.not_compared)
    return line


def _builtin(name: str | None, max_tokens: int) -> HooksFactory:
    """A built-in environment, as a hooks factory like any other: ``workplace`` (the reference
    tool environment) or ``completion`` (one model call per episode: rollsafe.env.completion)."""
    if name == "completion":
        from rollsafe.env.completion import CompletionEnv

        return CompletionEnv
    from rollsafe.reference.envs.workplace.env import WorkplaceEnv

    def make(context: ServeContext) -> EnvironmentHooks:
        assert context.engine is not None  # checked with the flags
        return WorkplaceEnv(context.engine, max_tokens=max_tokens)

    return make


async def _serve_hooks(
    factory: HooksFactory,
    context: ServeContext,
    engine_url: str | None,
    engine_token: str | None,
    switches: FaultSwitches,
    served: dict[str, Any],
) -> None:
    """Serve the hooks ``factory`` makes (built-in or ``--hooks``), behind the fault
    switches, with the policy engine reached over HTTP."""
    import dataclasses

    from rollsafe.engine.http import EngineClient
    from rollsafe.reference.envs.workplace.faults import FaultMiddleware

    engine = None
    if engine_url is not None and engine_token is not None:
        engine = EngineClient(engine_url, engine_token)
    try:
        env = make_hooks(factory, dataclasses.replace(context, engine=engine))
        wrap = lambda app: FaultMiddleware(app, served["token"], switches)  # noqa: E731
        await serve(env, wrap=wrap, **served)
    finally:
        if engine is not None:
            await engine.aclose()
