"""What a restore would do, found offline and without changing anything (``rollsafe restore
plan``): for an operator before a restore, and for tests.

It reads the run's snapshots and journal as a restore does (the selection with every candidate
passed over and why, every file checked, the journal replayed with its stops and gaps) into a
throwaway in-memory data plane, and stops before a restore's first write: no journal segment is
opened, nothing is set aside, no environment or engine is told. The controller's restore adds
only what needs the live run (the environments' answers) to the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from rollsafe.core.config import RunConfig
from rollsafe.core.phases import RestorePlan
from rollsafe.dataplane import make_dataplane
from rollsafe.errors import RollsafeError
from rollsafe.journal.run import RunJournal, restore_target
from rollsafe.snapshot import SnapshotStore, state_files


class RestorePreview(BaseModel):
    """What ``rollsafe restore plan --json`` prints."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    # Why a restore would be refused (the error's class and message); None: it would restore.
    refused: str | None = None
    plan: RestorePlan | None = None  # what it would restore, its journal replay included

    @property
    def restorable(self) -> bool:
        return self.refused is None


def preview_restore(
    store: SnapshotStore,
    *,
    weight_versions: Sequence[int] | None = None,
    accept_journal_loss: bool = False,
) -> RestorePreview:
    """What restoring ``store``'s run would do (``weight_versions`` and
    ``accept_journal_loss`` as a RestoreRequest's); nothing on disk changes."""
    try:
        return _preview(store, weight_versions, accept_journal_loss)
    except RollsafeError as exc:
        return RestorePreview(run_id=store.run_id, refused=f"{type(exc).__name__}: {exc}")


def _preview(
    store: SnapshotStore, weight_versions: Sequence[int] | None, accept_loss: bool
) -> RestorePreview:
    config = store.select(contents=False).read_json("run.json", RunConfig)
    journal = RunJournal.for_store(store, flush_ms=None, mirror_every_s=None)
    try:
        accept, replayer = restore_target(
            journal if config.journal else None, weight_versions, accept_loss=accept_loss
        )
        _, plan = state_files.restore(
            config, store, make_dataplane("memory"), accept=accept, journal=replayer
        )
    finally:
        journal.abandon_restore()  # a preview: nothing of the restore is written
        journal.close()
    if journal.replayed is not None:
        plan = plan.model_copy(update={"journal": journal.replayed.summary()})
    return RestorePreview(run_id=store.run_id, plan=plan)
