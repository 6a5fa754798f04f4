"""The admission gate: one holder at a time, idempotent per checkpoint id, atomic admission."""

import threading
from typing import Any

import pytest

from rollsafe.core.gate import AdmissionGate
from rollsafe.errors import GateHeld, InvalidInput
from rollsafe.testing.clock import HeldClock


def test_close_and_open_are_idempotent_per_checkpoint() -> None:
    gate = AdmissionGate()
    assert gate.is_open and gate.holder is None
    assert gate.close("ck-1").changed
    assert not gate.close("ck-1").changed  # a retried close_admission
    # Re-read after close(): mypy would otherwise keep the narrowing from the first assert.
    state: tuple[bool, str | None] = (gate.is_open, gate.holder)
    assert state == (False, "ck-1")
    assert gate.open("ck-1").changed
    again = gate.open("ck-1")
    assert not again.changed and "already open" in again.detail
    counters = gate.counters()
    assert (counters.closes, counters.opens) == (1, 1)


def test_a_second_checkpoint_cannot_close_a_held_gate() -> None:
    gate = AdmissionGate()
    gate.close("ck-1")
    with pytest.raises(GateHeld, match=r"ck-1.*ck-2") as caught:
        gate.close("ck-2")
    assert isinstance(caught.value, InvalidInput) and not caught.value.transient
    assert gate.holder == "ck-1"


def test_open_by_a_checkpoint_that_never_closed_it_is_a_no_op_that_says_so() -> None:
    gate = AdmissionGate()
    never = gate.open("ck-0")
    assert not never.changed and "did not hold it" in never.detail
    gate.close("ck-1")
    late = gate.open("ck-0")  # a late resume of an old checkpoint
    assert not late.changed and "held by ck-1" in late.detail
    assert gate.holder == "ck-1"
    assert gate.counters().opens == 0


def test_admit_counts_admitted_and_refused() -> None:
    gate = AdmissionGate()
    assert gate.admit()
    gate.close("ck-1")
    assert not gate.admit()
    gate.open("ck-1")
    assert gate.admit()
    counters = gate.counters()
    assert (counters.admitted, counters.refused) == (2, 1)


def test_close_waits_for_an_admission_in_progress() -> None:
    """What passes the gate is recorded before close returns: close cannot slip between the
    check and the caller's DISPATCHED mark."""
    gate = AdmissionGate()
    inside, release, closed = threading.Event(), threading.Event(), threading.Event()
    recorded: list[str] = []

    def dispatcher() -> None:
        with gate.admission() as admitted:
            assert admitted
            inside.set()
            release.wait(5)
            recorded.append("dispatched")

    def closer() -> None:
        gate.close("ck-1")
        recorded.append("closed")
        closed.set()

    first = threading.Thread(target=dispatcher)
    first.start()
    assert inside.wait(5)
    second = threading.Thread(target=closer)
    second.start()
    assert not closed.wait(0.1)  # blocked behind the admission
    release.set()
    first.join(5)
    second.join(5)
    assert recorded == ["dispatched", "closed"]
    assert not gate.admit()


@pytest.mark.parametrize("bad", ["", None, 3])
def test_invalid_checkpoint_ids_are_refused(bad: Any) -> None:  # not all str: on purpose
    gate = AdmissionGate()
    with pytest.raises(InvalidInput):
        gate.close(bad)
    with pytest.raises(InvalidInput):
        gate.open(bad)


def test_a_lease_not_renewed_reopens_the_gate_by_itself() -> None:
    clock, expired = HeldClock(100.0), []
    gate = AdmissionGate(clock, on_expired=lambda holder, _: expired.append(holder))
    assert "lease 10 s" in gate.close("ck-1", lease_s=10).detail
    clock.now += 9.9
    assert not gate.admit() and gate.holder == "ck-1" and gate.expired("ck-1") is None
    clock.now += 0.1
    assert gate.admit()  # the dispatch that finds the lease run out gets through
    assert gate.is_open and gate.expired("ck-1") == 10 and expired == ["ck-1"]
    counters = gate.counters()
    assert (counters.closes, counters.opens, counters.expired) == (1, 0, 1)


def test_renewals_keep_the_gate_closed_and_stop_once_it_expired() -> None:
    clock = HeldClock(100.0)
    gate = AdmissionGate(clock)
    assert not gate.renew("ck-1")  # not closed yet: nothing to renew
    gate.close("ck-1", lease_s=10)
    for _ in range(5):
        clock.now += 8
        assert gate.renew("ck-1")
    assert gate.holder == "ck-1"  # 40 s closed, never more than 8 s without a renewal
    assert not gate.renew("ck-2")  # only the holder renews
    clock.now += 10
    assert not gate.renew("ck-1") and gate.is_open  # too late: it expired
    late = gate.open("ck-1")  # the checkpoint's resume, when a worker came back
    assert not late.changed and "reopened by itself" in late.detail and "10 s" in late.detail


def test_after_an_expiry_the_next_checkpoint_closes_the_gate() -> None:
    clock, expired = HeldClock(100.0), []
    gate = AdmissionGate(clock, on_expired=lambda holder, _: expired.append(holder))
    gate.close("ck-1", lease_s=5)
    clock.now += 5
    assert gate.close("ck-2", lease_s=5).changed  # ck-1's lease was noticed first
    assert gate.holder == "ck-2" and expired == ["ck-1"]
    assert gate.expired("ck-2") is None and gate.open("ck-2").changed
    assert gate.counters().expired == 1


def test_a_lease_must_be_positive() -> None:
    with pytest.raises(InvalidInput, match="lease must be > 0"):
        AdmissionGate().close("ck-1", lease_s=0)


def test_wait_open_is_woken_by_the_holders_open() -> None:
    gate = AdmissionGate()
    gate.close("ck-1")
    woken: list[bool] = []
    waiter = threading.Thread(target=lambda: woken.append(gate.wait_open(60)))
    waiter.start()
    # The waiter holds no lock while it waits: closing again and renewing still work.
    assert not gate.close("ck-1").changed and gate.renew("ck-1")
    gate.open("ck-1")
    waiter.join(timeout=10)
    assert woken == [True]


def test_wait_open_times_out_on_a_held_gate_and_returns_at_once_on_an_open_one() -> None:
    gate = AdmissionGate()
    assert gate.wait_open(0) is True
    gate.close("ck-1")
    assert gate.wait_open(0.01) is False
    assert gate.holder == "ck-1"


def test_wait_open_sees_the_lease_run_out_without_another_call() -> None:
    clock = HeldClock(100.0)
    gate = AdmissionGate(clock)
    gate.close("ck-1", lease_s=5)
    clock.now += 6  # the lease is due: the waiter notices it by itself
    assert gate.wait_open(60) is True
    assert gate.expired("ck-1") == 5


def test_the_expiry_hook_runs_outside_the_gates_lock_and_is_told_how_long_it_held() -> None:
    """The hook logs and records a metric: it may read the gate (under the lock this would
    deadlock) and never holds up admission."""
    clock, seen = HeldClock(100.0), []
    gate = AdmissionGate(
        clock, on_expired=lambda holder, change: seen.append((holder, change.held_s, gate.is_open))
    )
    gate.close("ck-1", lease_s=5)
    clock.now += 2
    assert gate.renew("ck-1")
    clock.now += 5
    assert gate.admit()
    assert seen == [("ck-1", 7.0, True)]


def test_a_reopening_says_how_long_the_gate_was_closed() -> None:
    clock = HeldClock(100.0)
    gate = AdmissionGate(clock)
    gate.close("ck-1", lease_s=10)
    clock.now += 3.5
    assert gate.open("ck-1").held_s == 3.5
    assert gate.open("ck-1").held_s is None  # a repeat reopens nothing
