"""Phases 3-6 of a rollout snapshot when the run has participants (its environments and
engines): what :class:`~rollsafe.coordinator.CheckpointOps` hands over, each phase returning
the one-line summary and the counts of its result. (Phase 7, commit, writes into the
coordinator's draft and stays there.)

What a snapshot holds follows each parked episode's restore level, read from the ledger: only
``prefix`` groups' calls are cut, and only ``turn`` and ``prefix`` groups' episodes committed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from rollsafe import metrics
from rollsafe.controller import Controller
from rollsafe.env.protocol import EpisodeRef
from rollsafe.participants import Participants, to_episode
from rollsafe.phases import Phase, SnapshotSpec
from rollsafe.states import RestoreLevel

Outcome = tuple[str, dict[str, int]]
# The summaries of phases 3-7 when the run has no participants.
NOTHING_TO_DO = {
    Phase.RETIRE_DROPPED: "no environment instances configured: nothing to retire",
    Phase.PREPARE_ENVS: "no environment instances configured: nothing to park",
    Phase.DRAIN: "no environment instances configured: no replies on the wire to wait for",
    Phase.CUT_GENERATION: "no generation engines configured: nothing to cut",
    Phase.COMMIT_ENVS: "no environment instances configured: nothing to commit",
}


class ParticipantPhases:
    def __init__(
        self,
        participants: Participants,
        barrier: threading.Lock,
        controller: Callable[[], Controller],
    ) -> None:
        self.participants = participants
        self.barrier = barrier  # the coordinator's: held for every read of the controller
        self.controller = controller  # the current one (a restore replaces it)

    def run(self, spec: SnapshotSpec, phase: Phase) -> Outcome:
        cid = spec.checkpoint_id
        if phase is Phase.RETIRE_DROPPED:
            return self.retire_dropped()
        if phase is Phase.PREPARE_ENVS:
            prepared = self.participants.prepare(cid)
            parked = sum(len(i.parked) for i in prepared.instances.values())
            restarts = sum(len(i.restarts) for i in prepared.instances.values())
            summary = f"{len(prepared.instances)} instances parked {parked} episodes"
            return f"{summary}, {restarts} to restart", {"parked": parked}
        if phase is Phase.DRAIN:
            stragglers = self.participants.drain(cid)
            summary = f"{len(stragglers)} replies still out after the drain (restarted)"
            return summary, {"stragglers": len(stragglers)}
        if phase is Phase.CUT_GENERATION:
            return self.cut(spec)
        raise ValueError(f"{phase} is not a participant phase run here")

    def retire_dropped(self) -> Outcome:
        with self.barrier:
            retirements = self.controller().ledger.retirements()
        count = self.participants.retire(retirements)
        with self.barrier:
            self.controller().ledger.mark_retired(r.episode for r in retirements)
        return f"{count} abandoned attempts retired", {}

    def cut(self, spec: SnapshotSpec) -> Outcome:
        dataplane = self.controller().dataplane
        cut = self.participants.cut(spec.checkpoint_id, dataplane, self.level_of)
        metrics.record_cut(spec.run_id, cut)
        outcomes = metrics.cut_outcomes(cut)
        summary = (
            f"{outcomes['cut']} calls cut and staged, {outcomes['skipped']} skipped "
            f"(finished, not started, or a coarser restore level), {outcomes['failed']} "
            "could not be cut (turn level)"
        )
        return summary, outcomes

    def level_of(self, ref: EpisodeRef) -> RestoreLevel:
        """The restore level of a parked episode's group; an episode of a group the ledger
        does not hold is kept whole (the restore then names it as not owned by the run)."""
        idx = to_episode(ref).rollout.group.idx
        with self.barrier:
            ledger = self.controller().ledger
            return ledger.level(idx) if idx in ledger else RestoreLevel.PREFIX
