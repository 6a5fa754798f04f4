"""``rollsafe env serve`` and ``rollsafe env-check``: an environment's checkpoint protocol,
served and checked."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from rollsafe.env.serve import (
    HooksFactory,
    ServeContext,
    load_hooks_factory,
    make_hooks,
    serve,
)
from rollsafe.errors import InvalidInput, RollsafeError

if TYPE_CHECKING:
    from rollsafe.env.hooks import EnvironmentHooks
    from rollsafe.reference.envs.workplace.faults import FaultSwitches

ENVIRONMENTS = ("workplace",)


def _serve_args_problem(
    name: str | None,
    hooks: str | None,
    token: str,
    engine_url: str | None,
    engine_token: str | None,
) -> str | None:
    """What is wrong with ``env serve``'s arguments, if anything (the first problem)."""
    if (name is None) == (hooks is None):
        return "give an environment NAME or --hooks module:factory, not both"
    if name is not None and name not in ENVIRONMENTS:
        return f"no environment {name!r}; known: {', '.join(ENVIRONMENTS)}"
    if not token.strip():
        return "--token (or ROLLSAFE_ENV_TOKEN) must not be empty"
    if (engine_url is None) != (engine_token is None):
        return "--engine-url and --engine-token go together"
    if name is not None and engine_url is None:
        return f"{name} needs --engine-url and --engine-token"
    return None


def register_env_commands(app: typer.Typer, fail: Callable[[Exception, int], NoReturn]) -> None:
    """Add ``env serve`` and ``env-check`` to the ``rollsafe`` command."""
    env_cli = typer.Typer(
        no_args_is_help=True, help="Serve an environment's checkpoint protocol over HTTP."
    )
    app.add_typer(env_cli, name="env")

    @env_cli.command("serve")
    def env_serve(
        port: Annotated[
            int, typer.Option(help="TCP port (0: any free one; the line printed names it)")
        ],
        token: Annotated[
            str, typer.Option(envvar="ROLLSAFE_ENV_TOKEN", help="bearer token clients must send")
        ],
        name: Annotated[
            str | None, typer.Argument(help="a built-in environment: workplace (or use --hooks)")
        ] = None,
        hooks: Annotated[
            str | None,
            typer.Option(
                help="your own environment: package.module:factory, called with a "
                "rollsafe.env.serve.ServeContext, returning EnvironmentHooks"
            ),
        ] = None,
        engine_url: Annotated[
            str | None,
            typer.Option(help="the policy engine, e.g. http://host:port (workplace needs one)"),
        ] = None,
        engine_token: Annotated[
            str | None,
            typer.Option(envvar="ROLLSAFE_ENGINE_TOKEN", help="the engine's bearer token"),
        ] = None,
        instance: Annotated[
            str | None, typer.Option(help="instance name (default: <name>-<pid>)")
        ] = None,
        host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
        lease_grace_s: Annotated[
            float, typer.Option(help="a checkpoint's lease runs this long past its deadline")
        ] = 30.0,
        tool_wait_s: Annotated[
            float, typer.Option(help="how long a prepare waits for tool calls to end")
        ] = 5.0,
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
    ) -> None:
        """Serve an environment's checkpoint protocol and /episodes/run until SIGINT/SIGTERM: the
        built-in NAME, or your own hooks (--hooks). Prints one line, `rollsafe env serving <name>
        <instance> on http://host:port`, once listening."""
        import asyncio

        problem = _serve_args_problem(name, hooks, token, engine_url, engine_token)
        if problem is not None:
            fail(InvalidInput(problem), 2)
        from rollsafe.reference.envs.workplace.faults import parse_faults

        try:
            switches = parse_faults(faults)
            served: dict[str, Any] = {
                "host": host,
                "port": port,
                "token": token,
                "instance": instance,
                "lease_grace_s": lease_grace_s,
                "tool_wait_s": tool_wait_s,
            }
            factory = _workplace(max_tokens) if hooks is None else load_hooks_factory(hooks)
            asyncio.run(_serve_hooks(factory, engine_url, engine_token, switches, served))
        except RollsafeError as exc:
            fail(exc, 2)

    @app.command("env-check")
    def env_check(
        url: Annotated[str, typer.Argument(help="the instance, e.g. http://host:port")],
        token: Annotated[
            str, typer.Option(envvar="ROLLSAFE_ENV_TOKEN", help="the instance's bearer token")
        ],
        task: Annotated[
            str | None,
            typer.Option(help="an episode task as a JSON object (without: episode checks skip)"),
        ] = None,
        lease_wait_s: Annotated[
            float,
            typer.Option(help="wait this long past a deadline for the lease to run out (0: skip)"),
        ] = 60.0,
        engine_url: Annotated[
            str | None,
            typer.Option(help="the instance's policy engine: a call is cut there and must resume"),
        ] = None,
        engine_token: Annotated[
            str | None,
            typer.Option(envvar="ROLLSAFE_ENGINE_TOKEN", help="the engine's bearer token"),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    ) -> None:
        """Run the checkpoint protocol's conformance checks against the instance at URL (it must
        be idle and may run other episodes meanwhile). One line per check (on stderr with --json,
        which prints the report). Exit 0: every check passed or was skipped. 1: a check failed
        (named). 2: bad arguments, the instance unreachable, or the token refused (401)."""
        import asyncio
        import json

        from rollsafe.env.conformance import run_conformance

        try:
            episode_task = None if task is None else json.loads(task)
        except ValueError as exc:
            fail(InvalidInput(f"--task is not JSON: {exc}"), 2)
        if episode_task is not None and not isinstance(episode_task, dict):
            fail(InvalidInput("--task must be a JSON object"), 2)
        if not token.strip() or lease_wait_s < 0:
            fail(InvalidInput("--token must not be empty and --lease-wait-s not negative"), 2)
        if (engine_url is None) != (engine_token is None):
            fail(InvalidInput("--engine-url and --engine-token go together"), 2)
        try:
            report = asyncio.run(
                run_conformance(
                    url,
                    token,
                    task=episode_task,
                    lease_wait_s=lease_wait_s,
                    engine_url=engine_url,
                    engine_token=engine_token,
                    progress=lambda line: typer.echo(line, err=as_json),
                )
            )
        except RollsafeError as exc:
            fail(exc, 2)
        if as_json:
            typer.echo(report.model_dump_json(indent=2))
        else:
            failed = [c.name for c in report.checks if not c.passed]
            verdict = f"FAILED: {', '.join(failed)}" if failed else "all checks passed"
            typer.echo(f"{report.url} ({report.instance}): {verdict} in {report.seconds:.1f}s")
        if not report.passed:
            raise typer.Exit(1)


def _workplace(max_tokens: int) -> HooksFactory:
    """The built-in ``workplace`` environment, as a hooks factory like any other."""
    from rollsafe.reference.envs.workplace.env import WorkplaceEnv

    def make(context: ServeContext) -> EnvironmentHooks:
        assert context.engine is not None  # checked with the flags
        return WorkplaceEnv(context.engine, max_tokens=max_tokens)

    return make


async def _serve_hooks(
    factory: HooksFactory,
    engine_url: str | None,
    engine_token: str | None,
    switches: FaultSwitches,
    served: dict[str, Any],
) -> None:
    """Serve the hooks ``factory`` makes (built-in or ``--hooks``), behind the fault
    switches, with the policy engine reached over HTTP."""
    from rollsafe.engine.http import EngineClient
    from rollsafe.reference.envs.workplace.faults import FaultMiddleware

    engine = None
    if engine_url is not None and engine_token is not None:
        engine = EngineClient(engine_url, engine_token)
    try:
        env = make_hooks(factory, ServeContext(engine=engine))
        wrap = lambda app: FaultMiddleware(app, served["token"], switches)  # noqa: E731
        await serve(env, wrap=wrap, **served)
    finally:
        if engine is not None:
            await engine.aclose()
