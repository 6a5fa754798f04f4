"""``rollsafe doctor``: verify a deployment and name each failure with its fix.

Rows, in order: Temporal reachable, namespace exists, search attributes, clock skew
(:mod:`rollsafe.cli.doctor.temporal`); Ray reachable, snapshot storage
(:mod:`rollsafe.cli.doctor.checks`); each environment instance of the settings'
``participants.envs`` (:mod:`rollsafe.cli.doctor.participants`). Each is ok, FAILED (with the
command or setting that fixes it) or skipped (not configured, not allowed to look, or needing a
check that failed).
Skipped rows do not fail the run: the doctor checks what this deployment says it uses.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import BaseModel, ConfigDict

from rollsafe.cli.doctor.checks import DoctorCheck, Status, check_ray, check_storage
from rollsafe.cli.doctor.participants import env_checks
from rollsafe.cli.doctor.temporal import DEFAULT_MAX_SKEW_S, temporal_checks
from rollsafe.cli.exits import EXIT_CODES, ExitCode, fail
from rollsafe.cli.options import JsonOption
from rollsafe.errors import RollsafeError
from rollsafe.settings import ParticipantsSection, Settings
from rollsafe.temporal.connect import ConnectionSettings

DEFAULT_TIMEOUT_S = 5.0


class DoctorReport(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ok: bool
    checks: list[DoctorCheck]

    @classmethod
    def of(cls, checks: list[DoctorCheck]) -> DoctorReport:
        return cls(ok=all(c.status is not Status.FAILED for c in checks), checks=checks)


async def run_doctor(
    *,
    ray_address: str | None = None,
    snapshot_root: Path | str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_skew_s: float = DEFAULT_MAX_SKEW_S,
    settings: ConnectionSettings | None = None,
    participants: ParticipantsSection | None = None,
) -> DoctorReport:
    """Every check, each bounded by ``timeout_s`` per network call. ``settings`` (tests)
    replaces the worker's resolution from the environment; ``participants``: the run's
    environment instances to check (None: skipped)."""
    rows = await temporal_checks(timeout_s=timeout_s, max_skew_s=max_skew_s, settings=settings)
    # Socket connects and fsyncs block: off the loop, so nothing else on it stalls.
    rows.append(await asyncio.to_thread(check_ray, ray_address, timeout_s))
    rows.append(await asyncio.to_thread(check_storage, snapshot_root, timeout_s))
    rows += await env_checks(participants or ParticipantsSection(), timeout_s)
    return DoctorReport.of(rows)


def print_report(report: DoctorReport) -> None:
    from rollsafe.cli.checktable import print_check_table

    columns: tuple[str, ...] = ("check", "result", "detail", "fix")
    if not any(c.fix for c in report.checks):  # nothing to fix: the detail gets the width
        columns = columns[:3]
    rows = [(c.name, c.status.value, c.detail, c.fix)[: len(columns)] for c in report.checks]
    print_check_table("rollsafe doctor", rows, columns)


def register_doctor_command(app: typer.Typer) -> None:
    """Add ``doctor`` to the ``rollsafe`` command."""

    @app.command("doctor", epilog=EXIT_CODES)
    def doctor_command(
        ray_address: Annotated[
            str | None,
            typer.Option(
                envvar="RAY_ADDRESS",
                help="Ray cluster to check, host:port or ray://host:port (without: skipped)",
            ),
        ] = None,
        snapshot_root: Annotated[
            str | None,
            typer.Option(
                envvar="ROLLSAFE_SNAPSHOT_ROOT",
                help="snapshot root to probe: a directory (created and removed again if "
                "missing) or s3://bucket/prefix, gs://bucket/prefix (a probe object under "
                ".rollsafe-doctor/, deleted again); without: skipped",
            ),
        ] = None,
        max_skew_s: Annotated[
            float, typer.Option(min=0.0, help="largest clock difference with the Temporal server")
        ] = DEFAULT_MAX_SKEW_S,
        timeout_s: Annotated[
            float, typer.Option(min=0.1, help="limit on each network call, in seconds")
        ] = DEFAULT_TIMEOUT_S,
        as_json: JsonOption = False,
    ) -> None:
        """Verify a deployment: Temporal (found as `rollsafe worker` finds it: TEMPORAL_ADDRESS,
        TEMPORAL_NAMESPACE, TLS and API-key variables, or a temporal config profile) answers,
        its namespace exists, rollsafe's search attributes are registered, its clock agrees
        with this machine's; Ray answers; the snapshot root (a directory or a bucket) takes
        an atomic publish; each environment instance of the settings' participants.envs
        answers with the run's token under the name the run gives it (its --instance).

        Fails (1) when a check FAILED (named, with its fix); skipped ones are fine.
        """
        try:
            participants = Settings.load().participants
        except RollsafeError as exc:
            fail(exc, ExitCode.USAGE)
        report = asyncio.run(
            run_doctor(
                ray_address=ray_address,
                snapshot_root=snapshot_root,
                timeout_s=timeout_s,
                max_skew_s=max_skew_s,
                participants=participants,
            )
        )
        if as_json:
            sys.stdout.write(report.model_dump_json() + "\n")
        else:
            print_report(report)
        raise typer.Exit(int(ExitCode.OK if report.ok else ExitCode.FAILURE))
