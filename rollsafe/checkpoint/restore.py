"""A controller's restore (docs/design.md section 6): the newest snapshot that verifies loaded
into a fresh data plane, the journal replayed after it, the participants' episodes restored,
the run restarted; the controller's state replaced only once every step passed.

Each step's undo is here too: on any failure the run keeps its current state, the fresh data
plane is cleared (a remote one would keep a half-import forever), the journal's restart and
the environments' restore are abandoned.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from rollsafe.checkpoint.drafts import DraftSlot
from rollsafe.checkpoint.outcomes import log_restore, log_restore_failure
from rollsafe.checkpoint.restore_envs import abandon_restore, restore_envs, resume_restored
from rollsafe.checkpoint.run_service import RunService
from rollsafe.core.phases import RestorePlan, RestoreRequest
from rollsafe.core.run_state import EnvironmentsRestored, unchanged
from rollsafe.dataplane import DataPlane, make_dataplane
from rollsafe.engine.staging import drop_staged
from rollsafe.env.fleet_rules import FleetRestored
from rollsafe.errors import CheckpointRefused
from rollsafe.journal.run import restore_target
from rollsafe.observability import metrics
from rollsafe.snapshot import SnapshotStore, state_files

log = logging.getLogger("rollsafe.checkpoint.controller")  # what an operator filters on
KEEP_PLANS = 16  # restore ids whose plan a repeated call gets back


class Restores:
    """A controller's restores, each once per ``restore_id`` (a retried restore activity
    gets the first call's plan)."""

    def __init__(self, run: RunService, store: SnapshotStore, drafts: DraftSlot) -> None:
        self.run = run
        self.store = store
        self.drafts = drafts
        # Recent restores' plans (a retry comes within minutes: a few are plenty).
        self._plans: OrderedDict[str, RestorePlan] = OrderedDict()

    def restore(self, request: RestoreRequest) -> RestorePlan:
        with self.run.restoring:
            if (plan := self._plans.get(request.restore_id)) is not None:
                log.info(
                    "run %s restore %s replayed: the plan of its first call",
                    request.run_id,
                    request.restore_id,
                    extra={"run_id": request.run_id, "restore_id": request.restore_id},
                )
                return plan
            if (open_id := self.drafts.open_id()) is not None:
                raise CheckpointRefused(
                    f"restore {request.restore_id}: checkpoint {open_id} is open; it must "
                    "finish or abort first"
                )
            started = time.monotonic()
            try:
                plan = restore_run(self.run, self.store, request)
            except Exception as exc:
                log_restore_failure(request, exc, time.monotonic() - started)
                raise
            log_restore(request, plan, time.monotonic() - started)
            self._plans[request.restore_id] = plan
            while len(self._plans) > KEEP_PLANS:
                self._plans.popitem(last=False)
            self.run.awaiting_restore = False
            return plan


def restore_run(run: RunService, store: SnapshotStore, request: RestoreRequest) -> RestorePlan:
    """Replace ``run``'s state with the newest snapshot that verifies, in four steps under
    the barrier (so no dispatch sees a half-restored run): load, journal replay, the
    participants' restore, restart. The caller holds ``run.restoring``."""
    participants, journal = run.participants, run.journal
    accept, replayer = restore_target(
        journal, request.weight_versions, accept_loss=request.accept_journal_loss
    )
    fleet: FleetRestored | None = None
    tokens = 0
    with run.barrier:
        current = run.state
        fresh = make_dataplane(current.dataplane.name)
        try:
            restored, reader = state_files.load_newest(current.config, store, fresh, accept)
            replayed = replayer(restored, reader) if replayer is not None else None
            envs = EnvironmentsRestored({})
            if participants is not None:  # after the rows verified: they need the prefixes
                changed = replayed.changed if replayed is not None else unchanged
                envs, fleet, tokens = restore_envs(
                    participants, request.restore_id, reader, fresh, changed
                )
            plan = restored.restart_from(state_files.restored_from(reader), envs, replayed)
            if journal is not None:  # its restart durable before anyone is told
                journal.resume()
        except BaseException:
            _undo(run, request, fresh, fleet)
            raise
        run.state = restored
        current.dataplane.clear()  # replaced by the snapshot's rows
    if journal is not None and journal.replayed is not None:
        plan = plan.model_copy(update={"journal": journal.replayed.summary()})
    drop_staged(restored.dataplane)  # the environments hold what they needed of them
    if participants is not None and fleet is not None and fleet.ok:
        # (A failed environment restore was undone and resumed by the fleet itself.)
        resume_restored(participants, request.restore_id)
        metrics.record_restored_prefix_tokens(run.run_id, tokens)
    metrics.record_restore(run.run_id, plan, restored.config.group_size)
    return plan


def _undo(
    run: RunService, request: RestoreRequest, fresh: DataPlane, fleet: FleetRestored | None
) -> None:
    fresh.clear()  # a remote data plane would keep a half-import forever
    if run.journal is not None:
        run.journal.abandon_restore()
    if run.participants is not None and fleet is not None and fleet.ok:
        abandon_restore(run.participants, request.restore_id, fleet)
