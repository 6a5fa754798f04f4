"""A run state's files in a snapshot: what a capture writes into a draft, and the restore that
loads them back from the newest snapshot that verifies.

The file I/O half of :mod:`rollsafe.core.run_state` and :mod:`rollsafe.core.capture`, which
have none: the core takes a capture and checks it, restores from a loaded
:class:`~rollsafe.core.capture.CapturedState` and restarts; this module reads and writes the
snapshot's files around those steps (``ledger.safetensors``, ``replay_index.safetensors``,
``loader.json``, ``sampler.json``, ``run.json``, the data plane's export and its
``dataplane.json``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from rollsafe.core.buffer import SamplerState
from rollsafe.core.capture import CapturedState, Columns, LoaderState, check_agreement
from rollsafe.core.config import RunConfig
from rollsafe.core.phases import RestorePlan
from rollsafe.core.run_state import (
    ROLLOUT_PARTITION,
    Capture,
    Captured,
    EnvironmentsRestored,
    Replay,
    RestoredSnapshot,
    RunState,
)
from rollsafe.dataplane import DataPlane
from rollsafe.dataplane.protocol import DataPlaneManifest
from rollsafe.errors import ContentMismatch, LedgerInvariantViolation, SnapshotCorrupt
from rollsafe.faults import fault_point, register
from rollsafe.snapshot.draft import SnapshotDraft
from rollsafe.snapshot.manifest import FileEntry, SnapshotKind, SnapshotManifest
from rollsafe.snapshot.select import Accept, SnapshotReader
from rollsafe.snapshot.store import PublishedSnapshot, SnapshotStore
from rollsafe.snapshot.tensorfile import read_tensors, write_tensors

LEDGER_FILE = "ledger.safetensors"
INDEX_FILE = "replay_index.safetensors"
# Inside a capture, after the state files and before the data-plane export.
CAPTURE_MID = register("phase.capture.state_written")[0]

# Brings a restored snapshot's state forward by the journal after it and attaches the journal
# the run goes on appending to (rollsafe.journal.run.RunJournal.replayer).
ReplayJournal = Callable[[RunState, SnapshotReader], Replay]


# ---- writing ----------------------------------------------------------------------------------


def write_state(draft: SnapshotDraft, state: CapturedState) -> None:
    """The state's files into ``draft``; the state is in key order
    (:meth:`CapturedState.in_key_order`, as every caller has it for the agreement check)."""
    for relpath, (arrays, metadata) in ((LEDGER_FILE, state.ledger), (INDEX_FILE, state.index)):
        with draft.open(relpath) as out:
            write_tensors(out, arrays, metadata)
    draft.write_json("loader.json", state.loader)
    draft.write_json("sampler.json", state.sampler)
    draft.write_json("run.json", state.config)


def write_capture(run: RunState, draft: SnapshotDraft, capture: Capture) -> Captured:
    """Write ``capture`` (:meth:`RunState.take_capture`) into ``draft``: its state files in key
    order, once the ledger, the index and the data plane's rows of its sealed rollouts agree
    (else LedgerInvariantViolation, and nothing is published); then those rows (rows sealed
    since are left out; rows dropped since are still there) and every row of the other
    partitions (the staged prefixes). Needs no barrier: it reads the capture's views and rows
    the run cannot delete before :meth:`RunState.release_capture`, which the caller runs
    afterwards, whatever happened."""
    state = capture.state.in_key_order()
    sealed = state.sealed_keys()
    listed = set(run.dataplane.list(ROLLOUT_PARTITION))  # after resume: off the park
    check_agreement(state, sum(key in listed for key in sealed))
    write_state(draft, state)
    fault_point(CAPTURE_MID)
    exported = run.dataplane.export(draft.path / "dataplane", {ROLLOUT_PARTITION: sealed})
    draft.write_json("dataplane.json", exported)
    draft.record_hashed(
        {f"dataplane/{f.path}": FileEntry(sha256=f.sha256, bytes=f.bytes) for f in exported.files}
    )
    return Captured(
        weight_version=state.loader.weight_version,
        loader_position=state.loader.position,
        counts=capture.counts,
        journal_id=capture.journal_id,
    )


def publish(
    draft: SnapshotDraft, captured: Captured, anchor_step: int | None, anchors: Collection[int] = ()
) -> PublishedSnapshot:
    """Publish ``draft`` with the manifest ``captured``'s values make."""
    return draft.publish(
        weight_version=captured.weight_version,
        loader_position=captured.loader_position,
        anchor_step=anchor_step,
        counts=captured.counts,
        anchors=anchors,
        journal_id=captured.journal_id,
    )


def checkpoint(
    run: RunState,
    store: SnapshotStore,
    checkpoint_id: str,
    kind: SnapshotKind = SnapshotKind.ROLLOUT,
    anchor_step: int | None = None,
    seq: int | None = None,
) -> SnapshotManifest:
    """Capture, write and publish at once, with no phases around it: for tests and benchmarks
    of the state's files (a run's snapshots go through the controller's phases:
    rollsafe.checkpoint.phases.take_snapshot)."""
    # Leaving the block without publishing (any error) discards the draft.
    with store.begin(kind, checkpoint_id, seq) as draft:
        capture = run.take_capture()
        try:
            captured = write_capture(run, draft, capture)
        finally:
            run.release_capture()
        run.journaled(captured)
        return publish(draft, captured, anchor_step).manifest


# ---- reading ----------------------------------------------------------------------------------


def read_state(reader: SnapshotReader) -> CapturedState:
    """The state files of the snapshot ``reader`` reads, each hashed as it is read."""
    state = CapturedState(
        ledger=_read_columns(reader, LEDGER_FILE),
        index=_read_columns(reader, INDEX_FILE),
        loader=reader.read_json("loader.json", LoaderState),
        sampler=reader.read_json("sampler.json", SamplerState),
        config=reader.read_json("run.json", RunConfig),
    )
    manifest = reader.manifest
    if (state.loader.position, state.loader.weight_version) != (
        manifest.loader_position,
        manifest.weight_version,
    ):
        raise SnapshotCorrupt(f"{reader.name}: loader.json disagrees with the manifest")
    return state


def _read_columns(reader: SnapshotReader, relpath: str) -> Columns:
    return read_tensors(reader.read_bytes(relpath), f"{reader.name}/{relpath}")


def restore(
    config: RunConfig,
    store: SnapshotStore,
    dataplane: DataPlane,
    accept: Accept | None = None,
    environments: EnvironmentsRestored | None = None,
    journal: ReplayJournal | None = None,
) -> tuple[RunState, RestorePlan]:
    """Restore from the newest snapshot that verifies into ``dataplane`` (empty): load it
    (:func:`load_newest`), replay ``journal`` after it, restart (:meth:`RunState.restart_from`).
    ``environments``: what the run's environments restored (a controller restores them between
    the replay and the restart: rollsafe.checkpoint.restore). The new state is returned only if
    every check passed; on any error the snapshot directory is unchanged and ``dataplane``
    (which may hold imported rows) is discarded by the caller."""
    state, reader = load_newest(config, store, dataplane, accept)
    replayed = journal(state, reader) if journal is not None else None
    restored = environments if environments is not None else EnvironmentsRestored({})
    return state, state.restart_from(restored_from(reader), restored, replayed)


def restored_from(reader: SnapshotReader) -> RestoredSnapshot:
    """What a restore plan names of the snapshot ``reader`` read."""
    return RestoredSnapshot(
        snapshot=reader.path.name,
        checkpoint_id=reader.manifest.checkpoint_id,
        skipped=dict(reader.skipped),
    )


def load_newest(
    config: RunConfig, store: SnapshotStore, dataplane: DataPlane, accept: Accept | None
) -> tuple[RunState, SnapshotReader]:
    """The newest snapshot that verifies, loaded. Each file is hashed as it is loaded (the bytes
    hashed are the bytes decoded: one read, one hash), the files no load read after; a file
    that fails sends the restore to the next snapshot, as select would have."""
    refused: dict[str, str] = {}
    while True:
        reader = store.select(accept, contents=False, refused=refused)
        state = RunState(config, dataplane)
        try:
            _load(state, reader)
            reader.verify_unread()
        except ContentMismatch as exc:
            dataplane.clear()
            refused[reader.name] = str(exc)
            continue
        state.verify_rows(reader.name)
        return state, reader


def _load(run: RunState, reader: SnapshotReader) -> None:
    state = read_state(reader)
    run.load(state, reader.name, (f"{reader.name}/{LEDGER_FILE}", f"{reader.name}/{INDEX_FILE}"))
    exported = reader.read_json("dataplane.json", DataPlaneManifest)
    run.dataplane.import_(reader.path / "dataplane", exported)  # checks each file it reads
    reader.checked_elsewhere({f"dataplane/{f.path}": f.sha256 for f in exported.files})
    rows = run.dataplane.count(ROLLOUT_PARTITION)
    try:
        check_agreement(state, rows)
    except LedgerInvariantViolation as exc:
        raise SnapshotCorrupt(f"{reader.name}: {exc}") from None
    _check_counts(reader, {**state.counts(), "sealed_rollouts": rows})


def _check_counts(reader: SnapshotReader, found: Mapping[str, int]) -> None:
    """The counts the manifest carries are those of the files it lists: files of another
    snapshot, each with its right digest, are refused naming the count that differs."""
    listed = reader.manifest.counts
    differ = [f"{name} {listed[name]} in the manifest, {n} in its files"
              for name, n in found.items() if name in listed and listed[name] != n]  # fmt: skip
    if differ:
        raise SnapshotCorrupt(
            f"{reader.name}: its files disagree with its manifest: " + "; ".join(differ)
        )
