"""The admission gate: the switch that lets new episodes be dispatched (docs/design.md section 5).

A checkpoint closes it (phase ``close_admission``) and reopens it (phase ``resume``, which
runs on every exit path). At most one checkpoint holds it closed at a time, and only the
holder can reopen it, so a late ``resume`` of an old checkpoint never reopens the gate under
a newer one. Both operations are idempotent per checkpoint id because Temporal runs
activities at least once.

A dispatch passes the gate inside :meth:`AdmissionGate.admission`, which holds the gate's
lock while the caller marks the attempt DISPATCHED: once ``close`` returns, every attempt
that got through is already recorded, and none is left "waiting at the gate" half-counted.

Closing takes a **lease** (docs/design.md invariant 6: never left parked): the holder must renew
it (:meth:`AdmissionGate.renew`, which the phases holding the gate do while they run) or the
gate reopens by itself once the lease runs out, and the holder's checkpoint is then
*expired*: :meth:`AdmissionGate.expired` tells its later phases that they may not go on, so
nothing is published from a snapshot whose park outlived its lease. Expiry is noticed at the
next call on the gate (every dispatch is one), so no timer thread is needed.

Pure and thread-safe; no I/O. The clock is injectable, so tests need no sleeps.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from rollsafe.errors import GateHeld, InvalidInput

# Seconds a closed gate stays closed without a renewal. Long enough for Temporal to notice a
# dead worker (PhaseOptions.heartbeat_timeout_s, 5 s) and retry its phase on another one
# (backoff up to 5 s), short enough that a run with no worker left waits half a minute.
ADMISSION_LEASE_S = 30.0
# Checkpoint ids whose lease expired, remembered for their late phases; an older one's late
# phase is refused by the phase ledger, which remembers fewer (rollsafe.checkpoint.phase_ledger).
_KEEP_EXPIRED = 64
# A waiter whose holder's lease is already due (a fake clock in tests) looks again this often.
_EXPIRY_RECHECK_S = 0.01

Clock = Callable[[], float]
# Called with the expired holder and its change (held_s: how long it held the gate), after
# the gate's lock is released: a hook that logs or records a metric never holds up admission.
OnExpired = Callable[[str, "GateChange"], None]


@dataclass(frozen=True)
class GateChange:
    """What a close or open did: ``changed`` is False for an idempotent repeat or a no-op,
    and ``detail`` says which, in words an operator can read."""

    changed: bool
    detail: str
    # A reopening (by the holder or by its lease): how long the gate was closed, by its clock.
    held_s: float | None = None


class GateCounters(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    closes: int  # effective closes (repeats by the holder are not counted)
    opens: int  # effective reopens by the holder (resume or abort)
    expired: int  # reopened by themselves: the holder's lease ran out
    admitted: int
    refused: int


class AdmissionGate:
    def __init__(self, clock: Clock = time.monotonic, on_expired: OnExpired | None = None) -> None:
        self._lock = threading.Lock()
        self._reopened = threading.Condition(self._lock)  # notified when the gate opens
        self._clock = clock
        self._on_expired = on_expired
        self._holder: str | None = None
        self._lease_s = ADMISSION_LEASE_S
        self._deadline = 0.0  # clock time the holder's lease runs out
        self._closed_at = 0.0  # clock time the holder closed the gate
        self._to_notify: list[tuple[str, GateChange]] = []  # expiries the hook has not seen
        self._expired: OrderedDict[str, float] = OrderedDict()  # checkpoint -> lease seconds
        self._closes = 0
        self._opens = 0
        self._expiries = 0
        self._admitted = 0
        self._refused = 0

    @property
    def is_open(self) -> bool:
        with self._locked():
            return self._holder is None

    @property
    def holder(self) -> str | None:
        """The checkpoint holding the gate closed, or None when it is open."""
        with self._locked():
            return self._holder

    def close(self, checkpoint_id: str, lease_s: float = ADMISSION_LEASE_S) -> GateChange:
        """Close the gate for ``checkpoint_id`` under a lease of ``lease_s`` seconds."""
        _check_id(checkpoint_id)
        if not lease_s > 0:
            raise InvalidInput(f"admission lease must be > 0 seconds, got {lease_s!r}")
        with self._locked():
            if self._holder == checkpoint_id:
                return GateChange(False, f"already closed by {checkpoint_id}")
            if self._holder is not None:
                raise GateHeld(self._holder, checkpoint_id)
            self._holder, self._lease_s = checkpoint_id, lease_s
            self._closed_at = self._clock()
            self._deadline = self._closed_at + lease_s
            self._closes += 1
            return GateChange(True, f"closed by {checkpoint_id} (lease {lease_s:g} s)")

    def renew(self, checkpoint_id: str) -> bool:
        """Extend the holder's lease by its length from now. False (and nothing changes)
        when ``checkpoint_id`` does not hold the gate: not closed yet, reopened, or expired."""
        with self._locked():
            if self._holder != checkpoint_id:
                return False
            self._deadline = self._clock() + self._lease_s
            return True

    def expired(self, checkpoint_id: str) -> float | None:
        """The lease in seconds if ``checkpoint_id``'s lease ran out before it reopened the
        gate (so its snapshot may not go on), else None."""
        with self._locked():
            return self._expired.get(checkpoint_id)

    def open(self, checkpoint_id: str) -> GateChange:
        """Reopen the gate if ``checkpoint_id`` holds it; otherwise a no-op that says why."""
        _check_id(checkpoint_id)
        with self._locked():
            if self._holder == checkpoint_id:
                self._holder = None
                self._opens += 1
                self._reopened.notify_all()
                held_s = self._clock() - self._closed_at
                return GateChange(True, f"reopened by {checkpoint_id}", held_s)
            if checkpoint_id in self._expired:
                lease = self._expired[checkpoint_id]
                detail = f"already reopened by itself: {checkpoint_id}'s {lease:g} s lease expired"
                return GateChange(False, detail)
            if self._holder is None:
                return GateChange(False, f"already open; {checkpoint_id} did not hold it")
            return GateChange(False, f"held by {self._holder}, not {checkpoint_id}: left closed")

    def wait_open(self, timeout_s: float) -> bool:
        """Block until the gate is open or ``timeout_s`` seconds (real time) passed; True if
        open. Woken by :meth:`open` itself; a waiter also wakes when the holder's lease is due,
        so an expiry reopens it without any other call on the gate."""
        deadline = time.monotonic() + timeout_s
        try:
            with self._reopened:
                while True:
                    self._expire_if_due()
                    remaining = deadline - time.monotonic()
                    if self._holder is None or remaining <= 0:
                        return self._holder is None
                    until_expiry = max(self._deadline - self._clock(), _EXPIRY_RECHECK_S)
                    self._reopened.wait(min(remaining, until_expiry))
        finally:
            self._notify_expired()

    @contextmanager
    def admission(self) -> Iterator[bool]:
        """Yield whether a dispatch may pass, holding the gate's lock for the block so the
        caller records the dispatch before any ``close`` can complete. Keep the block short:
        ``close`` waits for it."""
        with self._locked():
            admitted = self._holder is None
            if admitted:
                self._admitted += 1
            else:
                self._refused += 1
            yield admitted

    def admit(self) -> bool:
        """Check the gate for one dispatch (when nothing needs recording atomically with it)."""
        with self.admission() as admitted:
            return admitted

    def counters(self) -> GateCounters:
        with self._locked():
            return GateCounters(
                closes=self._closes,
                opens=self._opens,
                expired=self._expiries,
                admitted=self._admitted,
                refused=self._refused,
            )

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The gate's lock, with a lease that ran out noticed first, and the expiry hook
        called once the lock is released."""
        try:
            with self._lock:
                self._expire_if_due()
                yield
        finally:
            self._notify_expired()

    def _expire_if_due(self) -> None:
        """Reopen the gate if the holder's lease ran out (called with the lock held)."""
        holder, now = self._holder, self._clock()
        if holder is None or now < self._deadline:
            return
        self._holder = None
        self._expiries += 1
        self._expired[holder] = self._lease_s
        while len(self._expired) > _KEEP_EXPIRED:
            self._expired.popitem(last=False)
        if self._on_expired is not None:
            change = GateChange(True, "lease expired", self._deadline - self._closed_at)
            self._to_notify.append((holder, change))

    def _notify_expired(self) -> None:
        hook = self._on_expired
        if hook is None:
            return
        with self._lock:
            due, self._to_notify = self._to_notify, []
        for holder, change in due:
            hook(holder, change)


def _check_id(checkpoint_id: str) -> None:
    if not isinstance(checkpoint_id, str) or not checkpoint_id:
        raise InvalidInput(f"invalid checkpoint id {checkpoint_id!r}")
