"""Each phase is one module of rollsafe.checkpoint.phases named after it, its handler in the one
``Phase -> handler`` table, and a checkpoint activity of the same name; the phase ledger (the
stored result per checkpoint and phase) on its own."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity

import rollsafe.checkpoint.phases as phases_package
from rollsafe.activities.controllers import ControllerClient
from rollsafe.activities.snapshot import SnapshotActivities
from rollsafe.checkpoint.phase_ledger import ABORT, PhaseLedger
from rollsafe.checkpoint.phases import HANDLERS
from rollsafe.core.phases import (
    FACTS,
    PARK_WINDOW,
    PARTICIPANT_PHASES,
    PHASES,
    Phase,
    PhaseResult,
    SnapshotSpec,
    abortable,
    holds_admission,
)
from rollsafe.errors import CheckpointRefused, InvalidInput, PhaseConflict

RUN = "ledger"


def spec(seq: int) -> SnapshotSpec:
    return SnapshotSpec(run_id=RUN, seq=seq)


def result(of: SnapshotSpec, phase: Phase) -> PhaseResult:
    return PhaseResult(phase=phase, checkpoint_id=of.checkpoint_id, summary="done")


def test_every_phase_has_its_module_its_handler_and_its_activity() -> None:
    assert list(HANDLERS) == list(PHASES)
    folder = Path(phases_package.__file__).parent
    for phase, handler in HANDLERS.items():
        assert handler.__module__ == f"rollsafe.checkpoint.phases.{phase.value}"
        assert (folder / f"{phase.value}.py").is_file()
    activities = SnapshotActivities(no_controller).all()
    names = {definition_of(fn) for fn in activities}
    assert {phase.value for phase in PHASES} <= names


def definition_of(fn: Callable[..., Any]) -> str | None:
    """The name an activity is registered under (the SDK keeps it on the function; its
    reader is private, the attribute is what the worker reads)."""
    return activity._Definition.must_from_callable(fn).name


def no_controller(run_id: str) -> ControllerClient:
    raise AssertionError(f"no activity runs here (asked for run {run_id})")


def test_a_stored_result_is_replayed_and_an_aborted_checkpoint_refuses_all_but_resume() -> None:
    ledger = PhaseLedger(RUN)
    first = spec(1)
    record = ledger.record(first)
    assert ledger.stored(record, Phase.OPEN) is None
    record.results[Phase.OPEN] = result(first, Phase.OPEN)
    replayed = ledger.stored(record, Phase.OPEN)
    assert replayed is not None and replayed.replayed and replayed.summary == "done"
    record.aborted = result(first, Phase.RESUME)
    with pytest.raises(CheckpointRefused, match=f"{first.checkpoint_id} was aborted: capture"):
        ledger.stored(record, Phase.CAPTURE)
    assert ledger.stored(record, Phase.RESUME) is None  # resume still runs
    assert issubclass(CheckpointRefused, PhaseConflict)


def test_a_resumed_checkpoint_is_refused_by_name() -> None:
    ledger = PhaseLedger(RUN)
    record = ledger.record(spec(1))
    ledger.refuse_if_resumed(record, "already resumed: may not close")  # not resumed: fine
    ledger.mark_resumed(record)
    with pytest.raises(PhaseConflict, match="already resumed: may not close"):
        ledger.refuse_if_resumed(record, "already resumed: may not close")


def test_old_records_are_forgotten_but_never_the_pinned_one() -> None:
    ledger = PhaseLedger(RUN, keep=3)
    pinned = spec(1)
    ledger.record(pinned)
    for seq in range(2, 8):
        ledger.record(spec(seq), pinned=pinned.checkpoint_id)
    assert ledger.get(pinned.checkpoint_id) is not None
    assert ledger.seqs() == [5, 1, 6, 7]  # the highest forgotten first: next_seq skips it
    assert ledger.get(spec(2).checkpoint_id) is None


def test_a_late_call_of_a_forgotten_checkpoint_is_refused_not_run_afresh() -> None:
    """Before, a checkpoint forgotten here (and by the gate, 64 expiries later) got a fresh
    record: its late open would have opened a draft nobody finishes."""
    ledger = PhaseLedger(RUN, keep=2)
    for seq in (1, 2, 3):
        ledger.record(spec(seq))
    with pytest.raises(CheckpointRefused, match=r"seq 1 <= 1, forgotten"):
        ledger.record(spec(1))
    assert ledger.get(spec(1).checkpoint_id) is None  # nothing made for it
    assert ledger.record(spec(4)).seq == 4  # a newer one is still welcome


def test_each_phase_is_described_once_and_the_derived_sets_follow() -> None:
    """The park window runs from close_admission to resume; the phases that hold admission
    are those strictly inside it; abort is possible only before capture."""
    assert list(FACTS) == list(PHASES)
    inside = PHASES[PHASES.index(Phase.CLOSE_ADMISSION) : PHASES.index(Phase.RESUME) + 1]
    assert set(inside) == PARK_WINDOW
    assert [p for p in PHASES if holds_admission(p)] == list(inside[1:-1])
    assert [p for p in PHASES if abortable(p)] == list(PHASES[: PHASES.index(Phase.CAPTURE)])
    assert PARTICIPANT_PHASES <= PARK_WINDOW and abortable(None)


def test_a_checkpoint_of_another_run_is_refused() -> None:
    with pytest.raises(InvalidInput, match="not of run ledger"):
        PhaseLedger(RUN).record(SnapshotSpec(run_id="other", seq=1))


def test_effects_are_counted_per_key_and_only_when_they_happened() -> None:
    ledger = PhaseLedger(RUN)
    workers = [threading.Thread(target=ledger.count, args=(Phase.CAPTURE, True)) for _ in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    ledger.count(ABORT, False)
    counts = ledger.effect_counts()
    assert counts[Phase.CAPTURE] == 8 and counts[ABORT] == 0
    assert set(counts) == {*PHASES, ABORT}
