"""``rollsafe verify`` and ``rollsafe demo``: a run's evidence, and the run that makes it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel, ConfigDict

from rollsafe.cli.exits import EXIT_CODES, ExitCode, fail
from rollsafe.cli.options import JsonOption, LogFormatOption, start_logging
from rollsafe.core.config import RestoreLevelName, SamplerName
from rollsafe.errors import RollsafeError
from rollsafe.evidence.verify import Check
from rollsafe.gym.servers import GymEnvironment
from rollsafe.settings import LogLevel


class VerifyReport(BaseModel):
    """What ``verify --json`` prints."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ok: bool
    checks: list[Check]


def _exit_with(checks: list[Check]) -> typer.Exit:
    return typer.Exit(int(ExitCode.OK if all(c.ok for c in checks) else ExitCode.FAILURE))


def register_run_commands(app: typer.Typer) -> None:
    """Add ``verify`` and ``demo`` to the ``rollsafe`` command."""

    @app.command("verify", epilog=EXIT_CODES)
    def verify_command(
        directory: Annotated[Path, typer.Argument(help="a run's --out directory (evidence files)")],
        against: Annotated[
            Path | None,
            typer.Option(help="a reference run's directory: every rollout's tokens must match"),
        ] = None,
        as_json: JsonOption = False,
    ) -> None:
        """Check a run's evidence files alone: no prompt skipped, every trained group trained once
        and whole, no rollout in two steps, no environment mutation applied twice (and, with
        --against, the same tokens as the reference run).

        Fails (1) on a violation (named); missing or malformed evidence is a usage error (2)."""
        from rollsafe.evidence.files import Evidence
        from rollsafe.evidence.verify import all_ok, verify

        try:
            evidence = Evidence.read(directory)
            reference = Evidence.read(against) if against is not None else None
        except RollsafeError as exc:
            fail(exc)
        checks = verify(evidence, reference)
        if as_json:
            report = VerifyReport(ok=all_ok(checks), checks=checks)
            sys.stdout.write(report.model_dump_json() + "\n")
        else:
            _print_checks(checks, f"rollsafe verify {directory}")
        raise _exit_with(checks)

    @app.command("demo", epilog=EXIT_CODES)
    def demo_command(
        out: Annotated[
            Path, typer.Option(help="evidence files and the run's work directory")
        ] = Path("demo-out"),
        steps: Annotated[int, typer.Option(min=1, help="optimizer steps")] = 6,
        seed: Annotated[int, typer.Option(help="model, task and sampling seed")] = 0,
        restore_level: Annotated[
            RestoreLevelName,
            typer.Option(help="how much of an interrupted rollout a restore keeps"),
        ] = "prefix",
        sampler: Annotated[
            SamplerName | None,
            typer.Option(help="which ready groups train (default: windowed)"),
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
            int,
            typer.Option(min=1, help="steps between trainer checkpoints (a restore's anchors)"),
        ] = 2,
        fault: Annotated[
            list[str] | None,
            typer.Option(
                help="KIND@WHERE, repeatable: coordinator@<phase>, run@step<k> (a snapshot "
                "mid-generation, then everything killed), kill@step<k> (everything killed "
                "between two snapshots), env@prepare, temporal@<phase> (the Temporal server "
                "killed while a snapshot is in that phase, then started again), "
                "env-lost@step<k> (an environment instance killed for good; the run restores "
                "onto the others)"
            ),
        ] = None,
        no_faults: Annotated[bool, typer.Option("--no-faults", help="inject nothing")] = False,
        journal: Annotated[
            bool,
            typer.Option(
                "--journal/--no-journal",
                help="a durable journal between snapshots (docs/journal.md); without it a "
                "kill loses what sealed since the last snapshot",
            ),
        ] = True,
        interval_s: Annotated[float, typer.Option(help="seconds between periodic snapshots")] = 3.0,
        gym: Annotated[
            GymEnvironment | None,
            typer.Option(
                help="NeMo Gym's own agent and resources server as the environments, unmodified, "
                "behind rollsafe's gateway (a scripted policy; default faults "
                "coordinator@capture, run@step2, kill@step3); needs make setup's .venv-gym"
            ),
        ] = None,
        engine: Annotated[
            Literal["reference", "vllm"],
            typer.Option(
                help="reference (rollsafe's torch engine, the default: the demo in ~2 minutes) "
                "or vllm (vLLM serving a tiny dense model built in --out; slower to start)"
            ),
        ] = "reference",
        log_level: Annotated[
            LogLevel | None,
            typer.Option(
                "--log-level",
                case_sensitive=False,
                help="the demo prints its own progress: its logs default to WARNING",
            ),
        ] = None,
        log_format: LogFormatOption = None,
    ) -> None:
        """Run the reference RL run on every real part (Temporal, Ray, engine and environment
        servers, a checkpoint worker), inject faults, restore, and verify the evidence.

        Fails (1) when a check fails or a part cannot start."""
        from rollsafe.reference.rl.demo import run_demo
        from rollsafe.reference.rl.demo_options import DemoOptions, Fault

        try:
            start_logging(log_level or "WARNING", log_format)
            chosen = () if no_faults else tuple(fault or ())
            # None given: the defaults, which DemoOptions picks (--gym has its own).
            faults = (
                {"faults": tuple(Fault.parse(f) for f in chosen)} if no_faults or chosen else {}
            )
            options = DemoOptions(
                out=out,
                steps=steps,
                seed=seed,
                restore_level=restore_level,
                sampler=sampler,
                deterministic=deterministic,
                checkpoint_every=checkpoint_every,
                interval_s=interval_s,
                engine=engine,
                journal=journal,
                gym=gym,
                **faults,
            )
        except ValueError as exc:  # InvalidInput, or pydantic's ValidationError of the options
            fail(exc, ExitCode.USAGE)
        try:
            checks = run_demo(options, say=lambda line: typer.echo(line))
        except RollsafeError as exc:
            fail(exc)
        _print_checks(checks, f"rollsafe verify {out}")
        raise _exit_with(checks)


def _print_checks(checks: list[Any], title: str) -> None:
    from rollsafe.cli.checktable import print_check_table

    rows = [(c.name, "ok" if c.ok else "VIOLATED", c.detail) for c in checks]
    print_check_table(title, rows)
