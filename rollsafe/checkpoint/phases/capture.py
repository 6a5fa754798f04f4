"""Phase 8, capture: take what the snapshot needs while the run stands still (under the run's
barrier: views, no copy, no I/O); publish writes it after resume, so the park window does not
grow with the ledger."""

from __future__ import annotations

from rollsafe.checkpoint.phases.context import PhaseContext
from rollsafe.core.phases import PhaseResult, SnapshotSpec
from rollsafe.errors import AnchorPassed


def capture(ctx: PhaseContext) -> PhaseResult:
    record, run = ctx.drafts.require(ctx.record), ctx.run
    with record.draft_lock, run.barrier:
        record.check_usable()
        if record.capture is None:
            _check_anchor(ctx.spec, run.state.weight_version)
            record.capture = run.state.take_capture()
            ctx.effect(True)
        counts = record.capture.counts
    summary = f"captured {counts['groups']} groups, {counts['sealed_rollouts']} sealed rollouts"
    return ctx.result(summary, counts)


def _check_anchor(spec: SnapshotSpec, version: int) -> None:
    """A trainer snapshot captures at its anchor's weight version or not at all."""
    if spec.kind == "trainer" and spec.anchor_step is not None and spec.anchor_step != version:
        raise AnchorPassed(
            f"anchor_passed: snapshot {spec.checkpoint_id} is anchored at weight version "
            f"{spec.anchor_step} and the controller is at {version} (a step committed "
            "before it could capture); to be sure of a snapshot at a trainer checkpoint, "
            "await Checkpointer.snapshot_now() before the next step commits"
        )
