"""``rollsafe snapshot now RUN`` and ``rollsafe restore RUN``: the trainer SDK's two calls an
operator makes from a shell (:class:`rollsafe.client.Checkpointer`), against the Temporal
server found as ``rollsafe worker`` finds it (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TLS and
API-key variables, or a temporal config profile)."""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from typer.core import TyperGroup

from rollsafe.cli.exits import EXIT_CODES, ExitCode, fail, temporal_client_made
from rollsafe.cli.options import AcceptJournalLossOption, JsonOption, RunArgument
from rollsafe.cli.progress import progress
from rollsafe.cli.snapshots import ROOT_ENV, ROOT_HELP
from rollsafe.core.ids import validate_run_id
from rollsafe.errors import CheckpointTimeout, RollsafeError

if TYPE_CHECKING:
    from temporalio.client import Client

    from rollsafe.client import Checkpointer
    from rollsafe.core.phases import JournalReplayed, RestorePlan
    from rollsafe.workflows.models import SnapshotOutcome

T = TypeVar("T")


async def _warn_without_workers(checkpointer: Checkpointer) -> None:
    """Say so at once when no worker serves the run: the call would wait for one, silently."""
    from temporalio.service import RPCError

    try:
        workers = await checkpointer.workers()
    except RPCError:
        return  # only a look: the call itself reports a server that fails
    if not workers.present:
        typer.echo(f"warning: {workers.absence()}", err=True)


def against_temporal(work: Callable[[Client], Awaitable[T]]) -> T:
    """``work`` with a client connected as the settings say (Temporal's own config, with the
    settings' ``temporal:`` section on top). Every failure, the server unreachable included:
    one line naming it, and its exit code."""
    from temporalio.service import RPCError

    from rollsafe.settings import Settings
    from rollsafe.temporal.connect import connect

    async def main() -> T:
        settings = Settings.load().connection()
        temporal_client_made()  # before: a failed connect has started the client's threads too
        return await work(await connect(settings))

    try:
        return asyncio.run(main())
    except RollsafeError as exc:
        fail(exc)
    except RPCError as exc:
        fail(f"the Temporal server failed the call: {exc.status.name} {exc.message}")


def _checkpointer_call(run: str, doing: str, call: Callable[[Checkpointer], Awaitable[T]]) -> T:
    """``call`` on the run's Checkpointer, with a spinner on a terminal while it waits."""
    from rollsafe.client import Checkpointer

    async def work(client: Client) -> T:
        checkpointer = Checkpointer(run, client=client)
        await _warn_without_workers(checkpointer)
        with progress(doing):
            return await call(checkpointer)

    return against_temporal(work)


def outcome_summary(run: str, outcome: SnapshotOutcome) -> str:
    if outcome.status == "published" and outcome.published is not None:
        info = outcome.published
        return (
            f"run {run!r}: snapshot {outcome.seq} published as {info.name} (checkpoint "
            f"{info.checkpoint_id}, weight version {info.weight_version}, loader position "
            f"{info.loader_position})"
        )
    why = f"{outcome.error_type}: {outcome.reason}" if outcome.error_type else outcome.reason
    return f"run {run!r}: snapshot {outcome.seq} {outcome.status}: {why}"


def plan_summary(done: str, plan: RestorePlan) -> str:
    """The plan in lines; ``done`` starts the first (``run 'r' restored (restore id i)``)."""
    regenerate = sum(len(group.regenerate) for group in plan.partial.values())
    lines = [
        f"{done} from {plan.snapshot} (checkpoint "
        f"{plan.checkpoint_id}): weight version {plan.weight_version}, loader position "
        f"{plan.loader_position}",
        f"  {len(plan.ready)} group(s) ready, {len(plan.partial)} partial "
        f"({regenerate} rollout(s) to generate again)",
    ]
    lines += [f"  newer snapshot {name} refused: {why}" for name, why in plan.skipped.items()]
    lines += [
        f"  environment {instance} did not restore: {why}"
        for instance, why in plan.environments_failed.items()
    ]
    lines += [f"  environment {name} {what}" for name, what in plan.environments_lost.items()]
    lines += journal_lines(plan.journal)
    return "\n".join(lines)


def journal_lines(journal: JournalReplayed | None) -> list[str]:
    """What the plan says of the journal, a line each: its replay, every stop, every loss."""
    if journal is None:
        return []
    lines = [
        f"  journal: {journal.records} record(s) replayed after record {journal.covered} "
        f"(to record {journal.last_id})"
    ]
    lines += [
        f"  journal stop: {stop.segment} record {stop.record} at offset {stop.offset}: "
        f"{stop.reason} ({stop.detail})"
        + (" [a restore went on after it]" if stop.superseded else "")
        for stop in journal.stops
    ]
    lines += [f"  journal loss accepted: {loss}" for loss in journal.accepted_loss]
    return lines


def snapshot_now_command(
    run: RunArgument,
    timeout: Annotated[
        float | None,
        typer.Option(min=0.0, help="seconds to wait for the outcome (default: until it ends)"),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Take a rollout snapshot of RUN now and print its outcome.

    The run's supervisor takes it after any queued ones. Fails (1) unless it was published.
    After --timeout the request stands: the snapshot still runs, and `rollsafe inspect RUN`
    shows it."""

    async def call(checkpointer: Checkpointer) -> SnapshotOutcome:
        return await checkpointer.snapshot_now(timeout=timeout)  # CheckpointTimeout after it

    outcome = _checkpointer_call(_valid(run), f"snapshot of run {run!r}", call)
    typer.echo(outcome.model_dump_json(indent=2) if as_json else outcome_summary(run, outcome))
    if outcome.status != "published":
        raise typer.Exit(int(ExitCode.FAILURE))


def restore_command(
    run: RunArgument,
    restore_id: Annotated[
        str | None,
        typer.Option(
            help="idempotency key: a restore retried with the same id returns the first plan "
            "(default: a new one, printed)"
        ),
    ] = None,
    weight_version: Annotated[
        list[int] | None,
        typer.Option(
            min=0,
            help="repeatable: weight versions the trainer holds checkpoints of; only a "
            "snapshot taken at one of them is restored (default: any)",
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(min=0.0, help="seconds to wait for the plan (default: until it ends)"),
    ] = None,
    accept_journal_loss: AcceptJournalLossOption = False,
    as_json: JsonOption = False,
) -> None:
    """Restore RUN's controller from its newest snapshot that verifies; print the plan.

    The snapshot must have been taken at one of the --weight-version given, if any. The plan
    says what the trainer loads and what is generated again. Runs the RestoreRun workflow:
    needs a worker of the run, and its controller awaiting restore (docs/operations.md,
    'Restart a trainer')."""
    restore_id = restore_id or f"cli-{uuid.uuid4().hex[:12]}"

    async def call(checkpointer: Checkpointer) -> RestorePlan:
        try:
            async with asyncio.timeout(timeout):
                return await checkpointer.restore(
                    restore_id,
                    weight_versions=weight_version,
                    accept_journal_loss=accept_journal_loss,
                )
        except TimeoutError:
            # The workflow goes on without us: the same id later returns its plan.
            raise CheckpointTimeout(
                f"restore of run {run!r} did not finish within {timeout:g} s; it goes on: "
                f"`rollsafe restore {run} --restore-id {restore_id}` returns its plan"
            ) from None

    plan = _checkpointer_call(_valid(run), f"restore of run {run!r}", call)
    typer.echo(
        plan.model_dump_json(indent=2)
        if as_json
        else plan_summary(f"run {run!r} restored (restore id {restore_id})", plan)
    )


def _valid(run: str) -> str:
    """The run id, checked before anything connects (a typo is a usage error, not a wait)."""
    try:
        return validate_run_id(run)
    except RollsafeError as exc:
        fail(exc)


def restore_plan_command(
    run: RunArgument,
    root: Annotated[str | None, typer.Option(envvar=ROOT_ENV, help=ROOT_HELP)] = None,
    weight_version: Annotated[
        list[int] | None,
        typer.Option(min=0, help="repeatable: as for `rollsafe restore` (default: any)"),
    ] = None,
    accept_journal_loss: AcceptJournalLossOption = False,
    as_json: JsonOption = False,
) -> None:
    """What restoring RUN would do, found offline; nothing on disk changes.

    The snapshot it would restore, every newer candidate passed over and why, the journal's
    replay (records, every stop, any gap) and what each group would become. Needs no Temporal
    server, worker or environment. Fails (1) when a restore would be refused, naming why."""
    from rollsafe.checkpoint.preview import preview_restore
    from rollsafe.settings import Settings
    from rollsafe.snapshot.location import open_snapshot_store

    try:
        root = root if root is not None else Settings.load().require_snapshot_root()
        with tempfile.TemporaryDirectory(prefix="rollsafe-plan-") as cache:
            store = open_snapshot_store(root, validate_run_id(run), cache_dir=cache)
            preview = preview_restore(
                store, weight_versions=weight_version, accept_journal_loss=accept_journal_loss
            )
    except RollsafeError as exc:
        fail(exc)
    if as_json:
        typer.echo(preview.model_dump_json(indent=2))
    elif preview.plan is not None:
        typer.echo(plan_summary(f"run {run!r} would be restored", preview.plan))
    if preview.refused is not None:
        fail(f"a restore of run {run!r} would be refused: {preview.refused}", ExitCode.FAILURE)


class _RestoreGroup(TyperGroup):
    """``rollsafe restore RUN`` restores (its command ``run``, the default); ``rollsafe restore
    plan RUN`` only says what a restore would do. (A run named "plan": ``restore run plan``.)"""

    # ctx: typer's own (vendored) click Context, which typer does not export.
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = ["run", *args]
        return super().parse_args(ctx, args)


def register_checkpointing_commands(app: typer.Typer, snapshot_group: typer.Typer) -> None:
    """Add ``snapshot now`` (to the ``snapshot`` group), ``restore`` and ``restore plan``."""
    snapshot_group.command("now", epilog=EXIT_CODES)(snapshot_now_command)
    restore = typer.Typer(
        cls=_RestoreGroup,
        no_args_is_help=True,
        help="Restore a run (`rollsafe restore RUN`), or see what a restore would do "
        "(`rollsafe restore plan RUN --root DIR`).",
    )
    app.add_typer(restore, name="restore")
    restore.command("run", epilog=EXIT_CODES, hidden=True)(restore_command)
    restore.command("plan", epilog=EXIT_CODES)(restore_plan_command)
