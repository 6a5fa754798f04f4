"""Phase 10, publish: write the capture into the draft (hash, write, fsync) while the run goes
on, then publish it (an atomic rename, or an upload to object storage); afterwards the journal
segments every retained snapshot covers are compacted.

A publish that finds no draft looks the snapshot up in the store (on disk, or in the bucket,
whatever this host's cache holds): an earlier attempt may have published it.
"""

from __future__ import annotations

import logging

from rollsafe.checkpoint.phases.context import PhaseContext, storage_errors
from rollsafe.checkpoint.record import CheckpointRecord
from rollsafe.core.phases import PhaseResult, PublishedSnapshotInfo
from rollsafe.core.run_state import Capture, Captured
from rollsafe.errors import CheckpointRefused, SnapshotLost
from rollsafe.observability import metrics
from rollsafe.snapshot import PublishedSnapshot, state_files

log = logging.getLogger(__name__)


def publish(ctx: PhaseContext) -> PhaseResult:
    with storage_errors(ctx.checkpoint_id, "publishing"):
        record = ctx.drafts.entry(ctx.checkpoint_id)
        published = _publish_draft(ctx, record) if record is not None else None
        if published is None:
            published = _find_published(ctx)
        if record is not None:  # this process wrote the draft (also if a failed try renamed it)
            metrics.record_capture_bytes(ctx.spec.run_id, published.manifest)
            _compact_journal(ctx)
    info = published_info(published)
    how = "reused the earlier publish of" if published.reused else "published"
    return ctx.result(f"{how} {info.name}", info.counts, info)


def published_info(published: PublishedSnapshot) -> PublishedSnapshotInfo:
    """A published snapshot, small enough for a workflow payload."""
    manifest = published.manifest
    return PublishedSnapshotInfo(
        name=published.name,
        path=str(published.path),
        checkpoint_id=manifest.checkpoint_id,
        manifest_sha256=published.manifest_sha256,
        weight_version=manifest.weight_version,
        loader_position=manifest.loader_position,
        counts=dict(manifest.counts),
    )


def _publish_draft(ctx: PhaseContext, record: CheckpointRecord) -> PublishedSnapshot | None:
    """Write and publish ``record``'s draft; None when an earlier attempt renamed it and
    failed after (the store then finds it). The draft's lock serialises duplicate attempts."""
    spec, published = ctx.spec, None
    with record.draft_lock:
        draft = record.files
        if record.capture is None:
            raise CheckpointRefused(f"checkpoint {spec.checkpoint_id}: publish before capture")
        done = record.captured or _write_capture(ctx, record, record.capture)
        if draft.path.exists():
            ctx.run.state.journaled(done)
            published = state_files.publish(draft, done, spec.anchor_step, spec.anchors)
            ctx.effect(not published.reused)
    ctx.drafts.closed(record)
    return published


def _write_capture(ctx: PhaseContext, record: CheckpointRecord, capture: Capture) -> Captured:
    """The capture's files and rows into the draft. A failure discards the draft (a retry
    would collide with the files written): the snapshot is taken again, nothing of the run is
    lost. The caller holds ``record.draft_lock``."""
    try:
        captured = state_files.write_capture(ctx.run.state, record.files, capture)
    except BaseException as exc:
        why = f"writing the capture failed ({type(exc).__name__}: {exc})"
        ctx.drafts.discard_locked(record, why)
        raise
    record.captured = captured
    ctx.drafts.end_capture(record)
    return captured


def _compact_journal(ctx: PhaseContext) -> None:
    """Delete the journal segments every retained snapshot covers. A failure costs disk only
    (the segments stay until the next publish), never the snapshot. Under the run's restore
    lock, not its barrier: the run's changes go on meanwhile."""
    journal = ctx.run.journal
    if journal is None:
        return
    try:
        with ctx.run.restoring:  # a restore may not swap the journal's segment meanwhile
            deleted = journal.compact(ctx.store)
    except Exception as exc:
        log.warning(
            "checkpoint %s: journal compaction failed (%s: %s); retried at the next publish",
            ctx.checkpoint_id,
            type(exc).__name__,
            exc,
        )
        return
    log.debug("checkpoint %s: %d journal segments compacted", ctx.checkpoint_id, deleted)


def _find_published(ctx: PhaseContext) -> PublishedSnapshot:
    """The snapshot an earlier attempt published for this checkpoint, verified where it
    lives (on disk, or downloaded from object storage: the local cache may be gone)."""
    spec = ctx.spec
    published = ctx.store.verify_published(spec.seq)
    if published is None:
        why = ctx.record.discarded
        where = (
            f"its draft was discarded ({why})"
            if why is not None
            else "no draft here (the controller restarted?)"
        )
        raise SnapshotLost(
            f"checkpoint {spec.checkpoint_id}: {where} and seq {spec.seq} is not "
            "published: take the snapshot again"
        )
    if published.manifest.checkpoint_id != spec.checkpoint_id:
        raise CheckpointRefused(
            f"seq {spec.seq} is published as {published.name} by checkpoint "
            f"{published.manifest.checkpoint_id}, not {spec.checkpoint_id}"
        )
    return published
