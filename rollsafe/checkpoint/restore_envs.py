"""A restore's environment step (docs/design.md section 6), between the journal's replay and
the restart: the snapshot's committed episodes brought back on the instances as attempt
n + 1, with the staged prefixes of their cut calls; then resumed, or, when the controller's
restore fails after, taken back."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import NamedTuple

from rollsafe.checkpoint.participants import Participants, to_episode
from rollsafe.checkpoint.phases.commit_envs import ENVS_DIR, RECORD_FILE, ParticipantsRecord
from rollsafe.core.ids import EpisodeId
from rollsafe.core.run_state import Changed, EnvironmentsRestored, unchanged
from rollsafe.dataplane import DataPlane
from rollsafe.engine.staging import load_prefixes
from rollsafe.env.fleet_rules import FleetRestored, Placement, place
from rollsafe.env.protocol import EpisodeRef
from rollsafe.snapshot import SnapshotReader

log = logging.getLogger("rollsafe.checkpoint.participants")


class EnvsRestored(NamedTuple):
    envs: EnvironmentsRestored  # what became of the snapshot's episodes, for the restart
    fleet: FleetRestored | None  # the fleet's outcome (None: the snapshot had no participants)
    prefix_tokens: int  # the tokens of the staged prefixes the instances were handed


def restore_envs(
    participants: Participants,
    restore_id: str,
    reader: SnapshotReader,
    dataplane: DataPlane,
    changed: Changed,
) -> EnvsRestored:
    """The snapshot's committed episodes restored on the instances (their staged prefixes
    read from ``dataplane``, where the snapshot was just loaded; episodes the journal
    ``changed`` left out), for :func:`resume_restored` or :func:`abandon_restore`. If the
    environments fail, the fleet has already retired every n + 1 attempt and resumed: those
    rollouts fall back to a restart from scratch (as n + 2) rather than failing the restore."""
    if RECORD_FILE not in reader.manifest.files:  # taken without participants
        return EnvsRestored(EnvironmentsRestored({}), None, 0)
    record = reader.read_json(RECORD_FILE, ParticipantsRecord)
    outcome, placement, tokens = _restore(
        participants, restore_id, reader.path, record, dataplane, changed
    )
    # A stranded episode (placement.stranded) is in neither: it restarts from scratch.
    if not outcome.ok:
        refused = frozenset(_previous(ref) for ref in outcome.restarts)
        failed = EnvironmentsRestored(
            {}, refused=refused, errors=outcome.errors, lost=placement.lost
        )
        return EnvsRestored(failed, outcome, 0)
    restored = EnvironmentsRestored(
        {_previous(ref): name for name, refs in outcome.restored.items() for ref in refs},
        moved=frozenset(to_episode(ref) for ref in placement.moved),
        lost=placement.lost,
    )
    return EnvsRestored(restored, outcome, tokens)


def _restore(
    participants: Participants,
    restore_id: str,
    snapshot_dir: Path,
    record: ParticipantsRecord,
    dataplane: DataPlane,
    changed: Changed = unchanged,
) -> tuple[FleetRestored, Placement, int]:
    """Bring the committed episodes back as attempt n + 1, but those the journal ``changed``
    since (sealed, restarted, or their group gone): each on its instance, or, for an instance
    no longer in the fleet, on a survivor (:func:`place`). All or nothing: on failure no
    instance keeps any (see :class:`FleetRestored`)."""
    fleet = participants.fleet
    committed = record.committed.instances
    scope = {
        name: [ref for ref in c.committed if not changed(to_episode(ref))]
        for name, c in committed.items()
    }
    portable = {name: all(m.portable for m in c.participants) for name, c in committed.items()}
    placement = place(scope, portable, fleet.names)
    for name, what in sorted(placement.lost.items()):
        log.warning("restore %s: instance %s is %s", restore_id, name, what)
    prefixes = load_prefixes(dataplane, record.staged) if record.staged else {}
    as_json = {call: p.model_dump(mode="json") for call, p in prefixes.items()}
    deadline = time.time() + participants.options.restore_deadline_s
    restored = participants.loop.run(
        fleet.restore_all(
            restore_id,
            record.committed.checkpoint_id,
            snapshot_dir.resolve() / ENVS_DIR,
            placement.own,
            as_json,
            deadline,
            adopted=placement.adopted,
        )
    )
    if restored.ok:
        for name, refs in sorted(restored.restored.items()):
            log.debug("restore %s: instance %s restored %d episodes", restore_id, name, len(refs))
    tokens = sum(len(p.tokens) for p in prefixes.values())
    return restored, placement, tokens


def resume_restored(participants: Participants, restore_id: str) -> None:
    """The restore succeeded: the environments resume."""
    participants.loop.run(participants.fleet.resume_all(restore_id))


def abandon_restore(participants: Participants, restore_id: str, restored: FleetRestored) -> None:
    """The controller's restore failed after the environments restored: they must not keep
    the n + 1 attempts (retired: refused until forgotten), and resume."""
    refs = {name: list(refs) for name, refs in restored.restored.items() if refs}
    fleet = participants.fleet

    async def undo() -> None:
        try:
            if refs:
                await fleet.retire_all(refs)
        finally:
            await fleet.resume_all(restore_id)

    participants.loop.run(undo())


def _previous(ref: EpisodeRef) -> EpisodeId:
    """Attempt n of a restored (or refused) attempt n + 1."""
    return to_episode(EpisodeRef(rollout_id=ref.rollout_id, attempt=ref.attempt - 1))
