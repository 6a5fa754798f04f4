"""``rollsafe snapshot list RUN`` and ``rollsafe ls RUN``: one command under two names, a run's
snapshots in a directory or on object storage, each verified, with why any would not be
restored."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from typing import Annotated

import typer
from pydantic import BaseModel, ConfigDict

from rollsafe.cli.exits import EXIT_CODES, ExitCode, fail
from rollsafe.cli.options import JsonOption, RunArgument
from rollsafe.cli.progress import Advance, progress
from rollsafe.core.ids import validate_run_id
from rollsafe.errors import RollsafeError, SchemaMismatch, SnapshotCorrupt
from rollsafe.snapshot import EntryState, SnapshotEntry, SnapshotStore
from rollsafe.snapshot.location import open_snapshot_store
from rollsafe.snapshot.remote import RemoteSnapshotStore

ROOT_ENV = "ROLLSAFE_SNAPSHOT_ROOT"
ROOT_HELP = (
    "snapshot root: a directory (holds <run>/snapshots/) or object storage "
    "(s3://bucket/prefix, gs://bucket/prefix; file:// is a directory)"
)


class SnapshotRow(BaseModel):
    """One entry of the listing: the table's row, as JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    state: EntryState
    seq: int | None
    kind: str | None
    checkpoint_id: str | None
    weight_version: int | None
    loader_position: int | None
    files: int | None
    reason: str | None

    @classmethod
    def of(cls, entry: SnapshotEntry) -> SnapshotRow:
        manifest = entry.manifest
        return cls(
            name=entry.name,
            state=entry.state,
            seq=entry.seq,
            kind=entry.kind.value if entry.kind is not None else None,
            checkpoint_id=manifest.checkpoint_id if manifest else None,
            weight_version=manifest.weight_version if manifest else None,
            loader_position=manifest.loader_position if manifest else None,
            files=len(manifest.files) if manifest else None,
            reason=entry.reason,
        )


class SnapshotListing(BaseModel):
    """What ``--json`` prints: every snapshot of the run, newest first, then the rest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    root: str
    verified: bool
    snapshots: list[SnapshotRow]

    @property
    def restorable(self) -> bool:
        return any(row.state is EntryState.VALID for row in self.snapshots)


def _checked(store: RemoteSnapshotStore, entry: SnapshotEntry) -> SnapshotEntry:
    """``entry`` (listed unverified) downloaded and verified, as ``store.list()`` would."""
    if entry.state is not EntryState.UNCHECKED or entry.seq is None:
        return entry  # a draft or a stray name: nothing published to verify
    try:
        published = store.verify_published(entry.seq)
    except (SnapshotCorrupt, SchemaMismatch) as exc:
        return dataclasses.replace(entry, state=EntryState.INVALID, reason=str(exc))
    if published is None:  # retention (or a sweep) took it between the listing and now
        why = "no longer published: deleted while listed"
        return dataclasses.replace(entry, state=EntryState.INVALID, reason=why)
    return dataclasses.replace(
        entry, path=published.path, state=EntryState.VALID, manifest=published.manifest
    )


def verify_one_by_one(
    store: RemoteSnapshotStore, listed: list[SnapshotEntry], advance: Advance
) -> list[SnapshotEntry]:
    """``listed`` (``store.list(verify=False)``) verified one snapshot at a time, so that each
    one downloaded can be counted: ``store.list(verify=True)`` says nothing until it has
    them all."""
    entries = []
    for entry in listed:
        entries.append(_checked(store, entry))
        if entry.state is EntryState.UNCHECKED:
            advance()
    return entries


def _entries(store: SnapshotStore, verify: bool) -> list[SnapshotEntry]:
    if not verify or not isinstance(store, RemoteSnapshotStore):
        return store.list(verify=verify)  # local hashing: no download to wait for
    listed = store.list(verify=False)
    published = sum(entry.state is EntryState.UNCHECKED for entry in listed)
    with progress(f"verifying snapshots of {store.url}", total=published) as advance:
        return verify_one_by_one(store, listed, advance)


def read_listing(root: str, run: str, verify: bool) -> SnapshotListing:
    """The listing of ``run`` under ``root``; nothing is written to the root (object storage
    is downloaded to a temporary directory, removed again)."""
    with tempfile.TemporaryDirectory(prefix="rollsafe-snapshots-") as cache:
        store = open_snapshot_store(root, run, cache_dir=cache)
        rows = [SnapshotRow.of(entry) for entry in _entries(store, verify)]
    return SnapshotListing(run_id=run, root=root, verified=verify, snapshots=rows)


def _print_table(listing: SnapshotListing) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table("snapshot", "state", "checkpoint", "weight", "loader", "files", "reason")
    for row in listing.snapshots:
        cells = (row.checkpoint_id, row.weight_version, row.loader_position, row.files)
        # Reasons quote paths and lists: escaped so "[...]" is never read as markup.
        table.add_row(
            row.name, row.state.value, *("" if c is None else str(c) for c in cells),
            escape(row.reason or ""),
        )  # fmt: skip
    Console(width=160).print(table)


def list_command(
    run: RunArgument,
    root: Annotated[str | None, typer.Option(envvar=ROOT_ENV, help=ROOT_HELP)] = None,
    verify: Annotated[
        bool, typer.Option(help="hash every file of every snapshot (--no-verify: names only)")
    ] = True,
    as_json: JsonOption = False,
) -> None:
    """Every snapshot of RUN, newest first, with its state and why it would not be restored.

    On object storage each one is downloaded to a temporary directory to be verified (with a
    progress bar on a terminal); nothing is written to the bucket. Fails (1) when no snapshot
    verifies."""
    from rollsafe.settings import Settings

    try:
        # Without --root or the variable: the settings file's snapshot_root (ROLLSAFE_CONFIG).
        root = root if root is not None else Settings.load().require_snapshot_root()
        listing = read_listing(root, validate_run_id(run), verify)
    except RollsafeError as exc:
        fail(exc)
    if as_json:
        sys.stdout.write(listing.model_dump_json() + "\n")
    else:
        _print_table(listing)
    if verify and not listing.restorable:
        fail(f"no snapshot of run {run!r} under {root} verifies", ExitCode.FAILURE)


def register_snapshot_commands(app: typer.Typer) -> typer.Typer:
    """Add the ``snapshot`` group (``snapshot list``; ``snapshots`` is the same group, kept for
    callers of the old name) and ``ls``; returns the group, for ``snapshot now``."""
    group = typer.Typer(
        no_args_is_help=True,
        help="A run's snapshots: list them (a directory or object storage), take one now.",
    )
    app.add_typer(group, name="snapshot")
    app.add_typer(group, name="snapshots", hidden=True)
    group.command("list", epilog=EXIT_CODES)(list_command)
    app.command(
        "ls",
        epilog=EXIT_CODES,
        help="A run's snapshots, each verified: `rollsafe snapshot list` under a short name.",
    )(list_command)
    return group
