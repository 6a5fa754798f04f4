"""The run service: one run's state (:class:`RunState`) behind the capture barrier, its
journal's durability, the restore fence, and the run's operations (hand out, dispatch, seal,
claim, commit, evict, ...). The controller (:mod:`rollsafe.checkpoint.controller`) exposes
these operations; a snapshot's capture takes the same barrier, so it sees the run standing
still.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

from rollsafe.checkpoint.participants import Participants, to_episode
from rollsafe.core.gate import AdmissionGate
from rollsafe.core.ids import EpisodeId, rollout_key
from rollsafe.core.run_state import ROLLOUT_PARTITION, RunState
from rollsafe.core.states import RestoreLevel
from rollsafe.dataplane import Row, row_digest
from rollsafe.env.protocol import EpisodeRef
from rollsafe.errors import AwaitingRestore, SealConflict, UnknownGroup
from rollsafe.journal.run import RunJournal


class OwedRollout(NamedTuple):
    """A rollout handed out and not sealed (:meth:`RunService.owed`)."""

    group: int
    sibling: int
    attempt: int  # its current attempt; dispatch starts the next one where needed
    owner: str | None  # the environment instance holding its episode; None: any


@dataclass
class _Reservation:
    """A seal in flight: its row is being put into the data plane."""

    key: str
    digest: bytes
    holders: int = 0  # seals of the same row in flight (a retry beside the first)


class RunService:
    """The run's state and its operations, each behind :attr:`barrier`.

    ``awaiting_restore`` (docs/design.md invariant 8): a controller started for a run that
    already has published snapshots refuses work until it has restored. It only ever goes from
    True to False, once, after a restore swapped the state in under the barrier, so it is read
    without a lock of its own."""

    def __init__(
        self,
        run_id: str,
        state: RunState,
        gate: AdmissionGate,
        participants: Participants | None,
        journal: RunJournal | None,
        *,
        awaiting_restore: bool,
    ) -> None:
        self.run_id = run_id
        self.state = state  # replaced whole by a restore, under the barrier
        self.gate = gate
        self.participants = participants
        self.journal = journal  # the run's changes between snapshots; None: the journal is off
        self.awaiting_restore = awaiting_restore
        # Held by capture and by every call that reads or changes the run's state.
        self.barrier = threading.Lock()
        self._sealing: dict[str, _Reservation] = {}  # row key -> its seal in flight
        # Held by a restore from start to end, and by journal compaction (which may not delete
        # segments a restore is reading); never by the run's operations.
        self.restoring = threading.Lock()

    @property
    def state(self) -> RunState:
        return self._state

    @state.setter
    def state(self, state: RunState) -> None:
        state.defer_deletes = True  # made by :meth:`changing`, outside the barrier
        self._state = state

    def check_fence(self, what: str) -> None:
        if self.awaiting_restore:
            raise AwaitingRestore(
                f"{what} refused: run {self.run_id} has published snapshots and this "
                "controller has not restored one; restore it first (Checkpointer.restore), "
                "or start the controller with start_over=True to begin the run again"
            )

    @contextmanager
    def changing(self, what: str, *, durable: bool = True) -> Iterator[None]:
        """The capture barrier, for a call that changes the run's state: refused while the
        controller awaits its restore. With the journal, returns once the change's records
        are durable (the barrier released meanwhile: others append to the same batch);
        ``durable=False``: a change whose loss costs nothing (a dispatch lost in a crash
        leaves its rollout reserved at the same attempt: it is dispatched again). The rows
        the change dropped are deleted from the data plane after the barrier is released
        (their groups are gone from the ledger already: nothing reads them)."""
        state, due = self.state, []
        try:
            with self.barrier:
                self.check_fence(what)
                state = self.state
                sink = state.journal if durable else None
                before = sink.last_id if sink is not None else None
                try:
                    yield
                finally:
                    due = state.take_due_deletes()
                after = sink.last_id if sink is not None else None
        finally:
            state.delete_rows(due)  # also when the change failed after dropping rows
        if sink is not None and after is not None and after != before:
            # Told only once durable: a change acknowledged is never lost (docs/journal.md).
            sink.wait_durable(after)

    # ---- changes -------------------------------------------------------------------------

    def handout(self, groups: Sequence[int]) -> None:
        with self.changing("handout"):
            self.state.handout(groups)

    def dispatch(self, idx: int, i: int, owner: str | None) -> EpisodeId | None:
        with self.changing("dispatch", durable=False), self.gate.admission() as admitted:
            if not admitted:
                return None
            return self.state.dispatch(idx, i, owner or self.placed(idx, i))

    def seal(self, idx: int, i: int, attempt: int, row: Row) -> bool:
        """Reserve, put, mark sealed: the row goes into the data plane (a Ray call, for
        TransferQueue) outside the barrier, so seals do not queue behind one another's puts.
        A reservation keeps a different row for the same rollout out meanwhile (SealConflict,
        as after the seal); the same row again may put beside it (puts replace whole rows)."""
        digest = row_digest(row)
        while True:
            with self.changing("seal", durable=False):
                state = self.state
                if not state.check_seal(idx, i, attempt, digest):
                    return False
                token = self._reserve(state.row_key(idx, i), digest)
            try:
                state.dataplane.put(ROLLOUT_PARTITION, {token.key: row})
                with self.changing("seal"):
                    if self.state is state:
                        return self._mark_sealed(state, idx, i, attempt, row, digest)
                # A restore replaced the run meanwhile: the row went to the data plane it
                # retired. Sealed anew against the restored run, if it still owes it.
                state.delete_rows([token.key])
            finally:
                self._release(token)

    def _reserve(self, key: str, digest: bytes) -> _Reservation:
        """Called under the barrier."""
        held = self._sealing.get(key)
        if held is not None and held.digest != digest:
            raise SealConflict(
                f"rollout {key}: a seal with different content is in flight "
                f"(this one: digest {digest.hex()[:12]})"
            )
        token = held or _Reservation(key, digest)
        token.holders += 1
        self._sealing[key] = token
        return token

    def _release(self, token: _Reservation) -> None:
        with self.barrier:
            token.holders -= 1
            if token.holders == 0:
                self._sealing.pop(token.key, None)

    def _mark_sealed(
        self, state: RunState, idx: int, i: int, attempt: int, row: Row, digest: bytes
    ) -> bool:
        """Called under the barrier. A group that left the run while its row was put (an
        eviction) leaves no row behind: its deletion is due, made once the barrier is
        released."""
        try:
            return state.mark_sealed(idx, i, attempt, row, digest)
        except UnknownGroup:
            state.discard_rows([rollout_key(self.run_id, idx, i)])
            raise

    def claim(self, groups: Sequence[int], step: int) -> None:
        with self.changing("claim"):
            self.state.claim(groups, step)

    def commit_step(self, groups: Sequence[int]) -> None:
        with self.changing("commit_step"):
            self.state.commit_step(groups)

    def evict(self, groups: Sequence[int]) -> None:
        with self.changing("evict"):
            for idx in groups:
                self.state.evict(idx)

    def set_weight_version(self, version: int) -> None:
        with self.changing("set_weight_version"):
            self.state.set_weight_version(version)

    # ---- reads ---------------------------------------------------------------------------

    def rows(self, groups: Sequence[int]) -> dict[int, list[Row]]:
        """Read outside the barrier (a remote data plane's get is a network call): the keys
        are the claimed groups', and claimed rows stay until their step commits."""
        with self.barrier:
            state = self.state
            keys = state.claimed_keys(groups)
        try:
            return state.rows_of(keys)
        except Exception:
            with self.barrier:
                if self.state is not state:  # restored meanwhile: its claims were released
                    self.state.claimed_keys(groups)  # says which, by name
            raise

    def instance_for(self, idx: int, i: int) -> str | None:
        with self.barrier:
            return self.placed(idx, i)

    def placed(self, idx: int, i: int) -> str | None:
        """:meth:`instance_for`, with the barrier held: the instance holding the rollout's
        episode, else round robin over the participants' instances."""
        owner = self.state.ledger.owner(idx, i)
        if owner is not None or self.participants is None:
            return owner
        return self.participants.instance_for(idx * self.state.config.group_size + i)

    def owed(self) -> list[OwedRollout]:
        with self.barrier:
            ledger = self.state.ledger
            return [
                OwedRollout(idx, i, ledger.attempt(idx, i), ledger.owner(idx, i))
                for idx, i in self.state.owed()
            ]

    def owned(self) -> int:
        with self.barrier:
            return len(self.state.index)

    def weight_version(self) -> int:
        with self.barrier:
            return self.state.weight_version

    def select(self) -> list[int]:
        with self.barrier:
            return self.state.select()

    def stale(self) -> list[int]:
        with self.barrier:
            return self.state.stale()

    def loader_position(self) -> int:
        with self.barrier:
            return self.state.loader_position

    def attempt(self, idx: int, i: int) -> int:
        with self.barrier:
            return self.state.ledger.attempt(idx, i)

    def level_of(self, ref: EpisodeRef) -> RestoreLevel:
        """The restore level of a parked episode's group; an episode of a group the ledger
        does not hold is kept whole (the restore then names it as not owned by the run)."""
        idx = to_episode(ref).rollout.group.idx
        with self.barrier:
            ledger = self.state.ledger
            return ledger.level(idx) if idx in ledger else RestoreLevel.PREFIX
