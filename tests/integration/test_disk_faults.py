"""The snapshot store's disk refuses a write at publish (issue 22, part 4): full, or read-only.
The snapshot fails as transient (StorageFailed) naming the cause, its draft is removed (on a
read-only disk: by the next snapshot's sweep), the previous snapshot stays the newest that
verifies, and nothing of the run changes; a retry of the phase names the cause too, and the
next snapshot publishes once the disk is writable.

On a real small filesystem (a 4 MiB tmpfs) where this machine lets the test mount one (root);
everywhere, the same through a fault point at the same call (``oserror:ENOSPC`` at
``phase.capture.state_written``, inside the capture's write)."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from rollsafe.checkpoint.controller import Controller
from rollsafe.core.columns import in_key_order
from rollsafe.core.phases import PHASES, Phase, PhaseRequest, PhaseResult, SnapshotSpec
from rollsafe.core.run_state import ROLLOUT_PARTITION
from rollsafe.dataplane import make_dataplane
from rollsafe.errors import SnapshotLost, StorageFailed
from rollsafe.evidence.scenario import busy_run
from rollsafe.faults import arm, disarm_all
from rollsafe.snapshot import SnapshotStore

pytestmark = pytest.mark.timeout(120)

RUN = "disk"
BEFORE_PUBLISH = PHASES[: PHASES.index(Phase.PUBLISH)]


def controller_at(root: Path) -> Controller:
    return Controller.from_parts(busy_run(RUN, make_dataplane("memory")), SnapshotStore(root, RUN))


def run(ops: Controller, seq: int, phase: Phase) -> PhaseResult:
    return ops.run_phase(PhaseRequest(spec=SnapshotSpec(run_id=RUN, seq=seq), phase=phase))


def publish_all(ops: Controller, seq: int) -> str:
    published = [run(ops, seq, phase) for phase in PHASES][-1].published
    assert published is not None
    return published.name


def picture(ops: Controller) -> tuple[object, ...]:
    """What the run holds: ledger, index, rows, the gate."""
    ledger = in_key_order(ops.state.ledger.capture()[0])
    index = in_key_order(ops.state.index.capture()[0])
    return (
        {k: v.tobytes() for k, v in ledger.items()},
        {k: v.tobytes() for k, v in index.items()},
        ops.state.dataplane.count(ROLLOUT_PARTITION),
        ops.status().gate_open,
    )


def drafts(store: SnapshotStore) -> list[str]:
    return sorted(p.name for p in store.snapshots_dir.iterdir() if p.name.startswith(".tmp-"))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:  # not root, or no CAP_SYS_ADMIN: the fault-point test covers it
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(disk: Path) -> Path:
    """Write until the disk refuses: the next byte anyone writes fails with ENOSPC."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as out:
        for size in (1 << 16, 1 << 12, 1):
            with pytest.raises(OSError, match="No space left") as full:
                _write_forever(out, b"\0" * size)
            assert full.value.errno == errno.ENOSPC
    return filler


def _write_forever(out: BinaryIO, chunk: bytes) -> None:
    while True:
        out.write(chunk)


def test_a_full_disk_fails_the_snapshot_as_transient_and_changes_nothing(small_disk: Path) -> None:
    ops = controller_at(small_disk)
    first = publish_all(ops, 1)
    for phase in BEFORE_PUBLISH:  # the run resumed: now the write
        run(ops, 2, phase)
    before = picture(ops)
    filler = fill(small_disk)

    with pytest.raises(StorageFailed, match="No space left on device"):
        run(ops, 2, Phase.PUBLISH)
    assert drafts(ops.store) == [] and ops.store.select().name == first
    assert picture(ops) == before
    with pytest.raises(SnapshotLost, match="No space left on device"):  # Temporal's retry
        run(ops, 2, Phase.PUBLISH)

    filler.unlink()
    assert ops.store.select().name < publish_all(ops, 3)


def test_a_read_only_disk_fails_the_snapshot_and_the_next_one_sweeps_its_draft(
    small_disk: Path,
) -> None:
    ops = controller_at(small_disk)
    first = publish_all(ops, 1)
    for phase in BEFORE_PUBLISH:
        run(ops, 2, phase)
    before = picture(ops)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        with pytest.raises(StorageFailed, match="Read-only file system"):
            run(ops, 2, Phase.PUBLISH)
        assert ops.store.select().name == first
        assert picture(ops) == before
        assert len(drafts(ops.store)) == 1  # nothing can remove it yet
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    publish_all(ops, 3)
    assert drafts(ops.store) == []  # swept by the next snapshot's open


def test_a_failed_write_through_the_fault_point_fails_the_same_way(tmp_path: Path) -> None:
    ops = controller_at(tmp_path)
    first = publish_all(ops, 1)
    for phase in BEFORE_PUBLISH:
        run(ops, 2, phase)
    before = picture(ops)
    arm("phase.capture.state_written", "oserror:ENOSPC", times=1)
    try:
        with pytest.raises(StorageFailed, match="No space left on device"):
            run(ops, 2, Phase.PUBLISH)
    finally:
        disarm_all()
    assert drafts(ops.store) == [] and ops.store.select().name == first
    assert picture(ops) == before
    publish_all(ops, 3)
