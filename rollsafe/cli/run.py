"""``rollsafe verify`` and ``rollsafe demo``: a run's evidence, and the run that makes it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from rollsafe.errors import RollsafeError


def register_run_commands(app: typer.Typer, fail: Callable[[Exception, int], NoReturn]) -> None:
    """Add ``verify`` and ``demo`` to the ``rollsafe`` command."""

    @app.command("verify")
    def verify_command(
        directory: Annotated[Path, typer.Argument(help="a run's --out directory (evidence files)")],
        against: Annotated[
            Path | None,
            typer.Option(help="a reference run's directory: every rollout's tokens must match"),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="one JSON object, no table")] = False,
    ) -> None:
        """Check a run's evidence files alone: no prompt skipped, every trained group trained once
        and whole, no rollout in two steps, no environment mutation applied twice (and, with
        --against, the same tokens as the reference run).

        Exit 0: every check passed. 1: a violation (named). 2: missing or malformed evidence.
        """
        import json

        from rollsafe.evidence.files import Evidence
        from rollsafe.evidence.verify import all_ok, verify

        try:
            evidence = Evidence.read(directory)
            reference = Evidence.read(against) if against is not None else None
        except RollsafeError as exc:
            fail(exc, 2)
        checks = verify(evidence, reference)
        if as_json:
            payload = {"ok": all_ok(checks), "checks": [c.model_dump() for c in checks]}
            sys.stdout.write(json.dumps(payload) + "\n")
        else:
            _print_checks(checks, f"rollsafe verify {directory}")
        raise typer.Exit(0 if all_ok(checks) else 1)

    @app.command("demo")
    def demo_command(
        out: Annotated[
            Path, typer.Option(help="evidence files and the run's work directory")
        ] = Path("demo-out"),
        steps: Annotated[int, typer.Option(help="optimizer steps")] = 6,
        seed: Annotated[int, typer.Option(help="model, task and sampling seed")] = 0,
        restore_level: Annotated[
            str, typer.Option(help="prefix | turn | sibling | prompt_group")
        ] = "prefix",
        sampler: Annotated[
            str | None,
            typer.Option(
                help="windowed (default) | in_order | weight_fifo: which ready groups train"
            ),
        ] = None,
        deterministic: Annotated[
            bool,
            typer.Option(
                "--deterministic",
                help="in-order sampler, no generation ahead: two runs with one seed train the "
                "same tokens (compare them with verify --against)",
            ),
        ] = False,
        checkpoint_every: Annotated[
            int, typer.Option(help="steps between trainer checkpoints (a restore's anchors)")
        ] = 2,
        fault: Annotated[
            list[str] | None,
            typer.Option(
                help="KIND@WHERE, repeatable: coordinator@<phase>, run@step<k>, env@prepare"
            ),
        ] = None,
        no_faults: Annotated[bool, typer.Option("--no-faults", help="inject nothing")] = False,
        interval_s: Annotated[float, typer.Option(help="seconds between periodic snapshots")] = 3.0,
        engine: Annotated[
            str,
            typer.Option(
                help="reference (rollsafe's torch engine, the default: the demo in ~2 minutes) "
                "or vllm (vLLM serving a tiny dense model built in --out; slower to start)"
            ),
        ] = "reference",
    ) -> None:
        """Run the reference RL run on every real part (Temporal, Ray, engine and environment
        servers, a checkpoint worker), inject faults, restore, and verify the evidence.

        Exit 0: the run finished and every check passed. 1: a check failed. 2: bad options or a
        part that could not start."""
        from rollsafe.evidence.verify import all_ok
        from rollsafe.reference.rl.demo import run_demo
        from rollsafe.reference.rl.demo_options import DEFAULT_FAULTS, DemoOptions, Fault

        try:
            chosen = () if no_faults else tuple(fault if fault else DEFAULT_FAULTS)
            options = DemoOptions(
                out=out,
                steps=steps,
                seed=seed,
                restore_level=restore_level,
                sampler=sampler,
                deterministic=deterministic,
                checkpoint_every=checkpoint_every,
                faults=tuple(Fault.parse(f) for f in chosen),
                interval_s=interval_s,
                engine=engine,
            )
            checks = run_demo(options, say=lambda line: typer.echo(line))
        except (RollsafeError, ValueError) as exc:
            fail(exc, 2)
        _print_checks(checks, f"rollsafe verify {out}")
        raise typer.Exit(0 if all_ok(checks) else 1)


def _print_checks(checks: list[Any], title: str) -> None:
    from rollsafe.cli.checktable import print_check_table

    rows = [(c.name, "ok" if c.ok else "VIOLATED", c.detail) for c in checks]
    print_check_table(title, rows)
