"""A participant's records on disk: round trip, verification, create-only manifest."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from rollsafe.env.protocol import ParticipantManifest
from rollsafe.env.store import MANIFEST, read_records, write_records
from rollsafe.errors import OwnershipMismatch, SnapshotCorrupt

RECORDS = [
    {"episode": {"rollout_id": "run-0_g0", "attempt": 0}, "state": {"turn": 2, "x": [1.5, "é"]}},
    {"episode": {"rollout_id": "run-1_g0", "attempt": 1}, "state": {}},
]


def write(dest: Path, checkpoint_id: str = "ck1", records: Any = RECORDS) -> ParticipantManifest:
    return write_records(dest, "toy", "environment", "toy-0", checkpoint_id, records)


def edit_manifest(dest: Path, **fields: Any) -> None:
    path = dest / "toy" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest.update(fields)
    path.write_text(json.dumps(manifest))


def test_round_trip(tmp_path: Path) -> None:
    manifest = write(tmp_path)
    assert read_records(tmp_path, "toy", "ck1") == RECORDS
    data = (tmp_path / manifest.file).read_bytes()
    assert manifest.file == f"toy/records-{manifest.sha256}.jsonl"
    assert hashlib.sha256(data).hexdigest() == manifest.sha256 and manifest.records == 2
    # Canonical lines: sorted keys, no spaces.
    assert data.splitlines()[1] == b'{"episode":{"attempt":1,"rollout_id":"run-1_g0"},"state":{}}'
    on_disk = ParticipantManifest.model_validate_json((tmp_path / "toy" / MANIFEST).read_bytes())
    assert on_disk == manifest
    assert sorted(p.name for p in (tmp_path / "toy").iterdir()) == sorted(
        [MANIFEST, Path(manifest.file).name]
    )  # no temp file left behind


def test_empty_and_generator_records(tmp_path: Path) -> None:
    assert write(tmp_path / "a", records=iter([])).records == 0
    assert read_records(tmp_path / "a", "toy", "ck1") == []
    assert write(tmp_path / "b", records=(r for r in RECORDS)).records == 2


def test_record_without_episode_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="episode"):
        write(tmp_path, records=[{"state": {}}])
    assert not (tmp_path / "toy" / MANIFEST).exists()
    assert [p.name for p in (tmp_path / "toy").iterdir()] == []  # the temp file is gone


def test_same_checkpoint_again_is_idempotent(tmp_path: Path) -> None:
    first = write(tmp_path)
    again = write(tmp_path, records=[{"episode": {}, "other": 1}])
    assert again == first
    assert read_records(tmp_path, "toy", "ck1") == RECORDS


def test_other_checkpoint_in_same_dir_refused(tmp_path: Path) -> None:
    write(tmp_path)
    with pytest.raises(OwnershipMismatch, match=r"ck1.*ck2"):
        write(tmp_path, "ck2")


def test_checkpoint_mismatch_named(tmp_path: Path) -> None:
    write(tmp_path)
    with pytest.raises(SnapshotCorrupt, match="holds checkpoint 'ck1', not 'ck2'"):
        read_records(tmp_path, "toy", "ck2")


def test_tampered_records_refused(tmp_path: Path) -> None:
    manifest = write(tmp_path)
    target = tmp_path / manifest.file
    target.write_bytes(target.read_bytes().replace(b'"turn":2', b'"turn":3'))
    with pytest.raises(SnapshotCorrupt, match=rf"{manifest.file}: sha256 .* differs"):
        read_records(tmp_path, "toy", "ck1")


def test_count_mismatch_named(tmp_path: Path) -> None:
    write(tmp_path)
    edit_manifest(tmp_path, records=3)
    with pytest.raises(SnapshotCorrupt, match="2 records, the manifest says 3"):
        read_records(tmp_path, "toy", "ck1")


def test_sha_mismatch_named(tmp_path: Path) -> None:
    manifest = write(tmp_path)
    other = "0" * 64
    (tmp_path / manifest.file).rename(tmp_path / "toy" / f"records-{other}.jsonl")
    edit_manifest(tmp_path, sha256=other, file=f"toy/records-{other}.jsonl")
    with pytest.raises(SnapshotCorrupt, match=f"records-{other}.jsonl: sha256"):
        read_records(tmp_path, "toy", "ck1")


def test_records_file_outside_its_folder_refused(tmp_path: Path) -> None:
    manifest = write(tmp_path)
    edit_manifest(tmp_path, file=f"../records-{manifest.sha256}.jsonl")
    with pytest.raises(SnapshotCorrupt, match="not where it belongs"):
        read_records(tmp_path, "toy", "ck1")


def test_unknown_manifest_field_refused(tmp_path: Path) -> None:
    write(tmp_path)
    edit_manifest(tmp_path, extra="x")
    with pytest.raises(SnapshotCorrupt, match=r"manifest.json: invalid manifest: extra"):
        read_records(tmp_path, "toy", "ck1")


def test_missing_manifest_named(tmp_path: Path) -> None:
    with pytest.raises(SnapshotCorrupt, match=r"manifest\.json: cannot read"):
        read_records(tmp_path, "toy", "ck1")


def _gated(records: list[dict[str, Any]], barrier: threading.Barrier) -> Iterator[dict[str, Any]]:
    # Both writers are past their "is there a manifest?" check before either can finish.
    barrier.wait(timeout=5)
    yield from records


def _race(dest: Path, second_id: str) -> list[ParticipantManifest | Exception]:
    barrier = threading.Barrier(2)
    other = [{"episode": {"rollout_id": "run-9_g0", "attempt": 0}, "state": {"z": 1}}]
    jobs = [("ck1", RECORDS), (second_id, other)]

    def one(job: tuple[str, list[dict[str, Any]]]) -> ParticipantManifest | Exception:
        try:
            return write(dest, job[0], _gated(job[1], barrier))
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, jobs))


@pytest.mark.parametrize("attempt", range(5))
def test_racing_writers_same_checkpoint_one_wins(tmp_path: Path, attempt: int) -> None:
    first, second = _race(tmp_path, "ck1")
    assert isinstance(first, ParticipantManifest) and first == second
    assert len(list((tmp_path / "toy").glob("records-*.jsonl"))) == 1  # the loser's is gone
    assert len(read_records(tmp_path, "toy", "ck1")) == first.records  # the winner's records


@pytest.mark.parametrize("attempt", range(5))
def test_racing_writers_other_checkpoint_one_fails(tmp_path: Path, attempt: int) -> None:
    results = _race(tmp_path, "ck2")
    won = [r for r in results if isinstance(r, ParticipantManifest)]
    lost = [r for r in results if isinstance(r, Exception)]
    assert len(won) == 1 and len(lost) == 1 and isinstance(lost[0], OwnershipMismatch)
    assert len(read_records(tmp_path, "toy", won[0].checkpoint_id)) == won[0].records
    on_disk = ParticipantManifest.model_validate_json((tmp_path / "toy" / MANIFEST).read_bytes())
    assert on_disk == won[0]


def test_records_of_an_environment_that_is_not_portable_say_so(tmp_path: Path) -> None:
    """Read back by a restore that must decide where a lost instance's episodes go."""
    records = [{"episode": {"rollout_id": "r-0_g0", "attempt": 0}, "state": {}}]
    written = write_records(tmp_path, "toy", "environment", "toy-0", "ck1", records, portable=False)
    on_disk = json.loads((tmp_path / "toy" / MANIFEST).read_text())
    assert on_disk["portable"] is False and not written.portable
    assert not ParticipantManifest.model_validate(on_disk).portable
