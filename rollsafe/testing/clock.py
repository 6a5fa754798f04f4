"""A clock the test moves: pass it where rollsafe takes an injectable ``clock`` (the admission
gate, the phase ledger, a participant, a watchdog) and a lease runs out when the test says so,
with no sleep."""

from __future__ import annotations


class HeldClock:
    """Stands at :attr:`now` until the test moves it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
