"""The TransferQueue data plane on a real Ray and a real TransferQueue 0.1.11 (one per session):
exact reads, named missing keys, digest checks, namespaces, and export/import in rollsafe's own
format, across backends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollsafe.dataplane.memory import MemoryDataPlane
from rollsafe.dataplane.protocol import DataPlane, row_digest
from rollsafe.dataplane.tq_runtime import import_tq
from rollsafe.dataplane.transferqueue import BATCH_ROWS, TransferQueueDataPlane
from rollsafe.errors import (
    DataPlaneCorrupt,
    DataPlaneKeyMissing,
    InvalidInput,
    SchemaMismatch,
    SnapshotCorrupt,
)

pytestmark = pytest.mark.usefixtures("transferqueue")


@pytest.fixture
def planes() -> Iterator[Any]:
    made: list[TransferQueueDataPlane] = []

    def make(**options: Any) -> TransferQueueDataPlane:
        made.append(TransferQueueDataPlane(**options))
        return made[-1]

    yield make
    for plane in made:
        plane.clear()


def awkward_rows() -> dict[str, dict[str, np.ndarray]]:
    """What TransferQueue alone gets wrong: one field name with several dtypes in one
    partition, field sets that differ by row, empty, 0-d and n-d arrays, no fields at all."""
    rng = np.random.default_rng(11)
    grid = rng.standard_normal((4, 6)).astype(np.float32)
    return {
        "a": {"tokens": np.arange(7, dtype=np.int64), "reward": np.array(0.5, np.float32)},
        "b": {"tokens": np.arange(3, dtype=np.int32)},  # same field, another dtype
        "c": {"tokens": np.zeros(0, np.int64), "routes": np.ones((5, 2, 2), np.int16)},
        "d": {"grid": grid[:, ::2]},  # not contiguous
        "e": {},
        "f": {
            "mask": np.array([True, False]),
            "u": np.array([1, 2**63], np.uint64),
            "h": np.array([1.5, -0.0], np.float16),
            "nan": np.array([np.nan, -np.inf], np.float32),
        },
        "ключ/🙂": {"tokens": np.arange(2, dtype=np.int64)},
    }


def digests(rows: dict[str, Any]) -> dict[str, bytes]:
    # row_digest covers field names, dtypes, shapes and bytes: equal digests, identical rows.
    return {key: row_digest(row) for key, row in rows.items()}


def test_rows_come_back_exactly_and_read_only(planes: Any) -> None:
    plane = planes()
    assert isinstance(plane, DataPlane)
    rows = awkward_rows()
    plane.put("rollouts", rows)
    asked = ["f", "a", "e", "ключ/🙂", "a", "c", "b", "d"]
    got = plane.get("rollouts", asked)
    assert list(got) == list(dict.fromkeys(asked))
    assert digests(got) == digests({key: rows[key] for key in got})
    with pytest.raises(ValueError, match="assignment destination is read-only"):
        got["a"]["tokens"][0] = 9
    assert plane.list("rollouts") == sorted(rows)
    assert plane.count("rollouts") == len(rows) and plane.partitions() == ["rollouts"]


def test_put_copies_and_a_reput_replaces_the_whole_row(planes: Any) -> None:
    plane = planes()
    tokens = np.arange(4, dtype=np.int64)
    plane.put("p", {"k": {"tokens": tokens, "old": np.zeros(2)}})
    tokens[:] = 99  # the caller's array changes after the put: the stored row does not
    assert plane.get("p", ["k"])["k"]["tokens"].tolist() == [0, 1, 2, 3]
    plane.put("p", {"k": {"new": np.ones(3, np.float32)}})
    assert sorted(plane.get("p", ["k"])["k"]) == ["new"]


def test_a_read_names_every_missing_key_and_never_returns_short(planes: Any) -> None:
    plane = planes()
    plane.put("p", {"x": {"v": np.zeros(1)}, "y": {"v": np.ones(1)}})
    # TransferQueue's own multi-key get drops unknown keys silently: 2 rows for 4 keys.
    dropped = import_tq().kv_batch_get(
        keys=["x", "nope", "y", "gone"], partition_id=f"{plane.namespace}/p"
    )
    assert dropped.batch_size[0] == 2
    with pytest.raises(DataPlaneKeyMissing) as info:
        plane.get("p", ["x", "nope", "y", "gone"])
    assert info.value.missing == ["gone", "nope"]
    with pytest.raises(DataPlaneKeyMissing):
        plane.get("never", ["x"])
    with pytest.raises(DataPlaneKeyMissing):
        plane.delete("p", ["x", "nope"])
    assert plane.list("p") == ["x", "y"]  # the delete that named a missing key deleted nothing
    many = {f"m{i:03d}": {"v": np.array([i])} for i in range(2 * BATCH_ROWS)}
    plane.put("m", many)
    with pytest.raises(DataPlaneKeyMissing) as info:  # missing keys in both batches of the read
        plane.get("m", ["lost-1", *list(many)[:BATCH_ROWS], "lost-2", "lost-3"])
    assert info.value.missing == ["lost-1", "lost-2", "lost-3"]


def test_a_key_whose_put_never_finished_is_missing(planes: Any) -> None:
    plane = planes()
    plane.put("p", {"done": {"v": np.zeros(2)}})
    # A put that fails after registering its keys leaves them in the controller, untagged.
    client = import_tq().get_client()
    client.kv_retrieve_meta(keys=["half"], partition_id=f"{plane.namespace}/p", create=True)
    with pytest.raises(DataPlaneKeyMissing, match="half"):
        plane.get("p", ["done", "half"])
    assert plane.list("p") == ["done"] and plane.count("p") == 1


def test_a_row_changed_behind_the_planes_back_is_refused(planes: Any) -> None:
    plane = planes()
    plane.put("p", {"k": {"v": np.arange(3, dtype=np.int64)}})
    import torch
    from tensordict import TensorDict

    changed = torch.nested.nested_tensor([torch.tensor([0, 1, 7])], layout=torch.jagged)
    import_tq().kv_batch_put(
        keys=["k"],
        partition_id=f"{plane.namespace}/p",
        fields=TensorDict({"v:i8": changed}, batch_size=[1]),
    )
    with pytest.raises(DataPlaneCorrupt, match="digest"):
        plane.get("p", ["k"])


def test_namespaces_keep_planes_apart(planes: Any) -> None:
    first, second = planes(), planes()
    first.put("p", {"k": {"v": np.zeros(1)}})
    assert second.partitions() == [] and second.count("p") == 0
    with pytest.raises(DataPlaneKeyMissing):
        second.get("p", ["k"])
    second.put("p", {"k": {"v": np.ones(1)}})
    first.clear()
    assert first.partitions() == [] and second.get("p", ["k"])["k"]["v"].tolist() == [1.0]
    with pytest.raises(InvalidInput):
        TransferQueueDataPlane(namespace="a/b")


def test_bad_rows_are_refused_and_store_nothing(planes: Any) -> None:
    plane = planes()
    with pytest.raises(InvalidInput):
        plane.put("p", {"ok": {"v": np.zeros(1)}, "bad": {"v": [1, 2]}})
    with pytest.raises(InvalidInput):
        plane.put("p", {"ok": {"v": np.zeros(1, dtype=">i4")}})
    assert plane.partitions() == []


def export_then_import(source: DataPlane, target: DataPlane, directory: Path) -> None:
    manifest = source.export(directory)
    assert all(f.path.endswith((".json", ".safetensors")) for f in manifest.files)  # no pickle
    target.import_(directory, manifest)


@pytest.mark.parametrize("route", ["tq->tq", "tq->memory", "memory->tq"])
def test_export_round_trips_across_backends(planes: Any, tmp_path: Path, route: str) -> None:
    rows = awkward_rows()
    many = {
        f"r{i:04d}": {"tokens": np.full(i % 50, i, np.int32)} for i in range(2 * BATCH_ROWS + 7)
    }
    source = MemoryDataPlane() if route.startswith("memory") else planes(shard_bytes=16 << 10)
    target = MemoryDataPlane() if route.endswith("memory") else planes()
    source.put("rollouts", rows)
    source.put("prefixes", many)
    export_then_import(source, target, tmp_path / "export")
    assert target.partitions() == ["prefixes", "rollouts"]
    assert digests(target.get("rollouts", sorted(rows))) == digests(rows)
    assert digests(target.get("prefixes", sorted(many))) == digests(many)


def test_import_needs_an_empty_namespace_and_a_bad_export_leaves_it_empty(
    planes: Any, tmp_path: Path
) -> None:
    source = planes()
    source.put("rollouts", awkward_rows())
    manifest = source.export(tmp_path / "export")
    busy = planes()
    busy.put("mine", {"k": {"v": np.zeros(1)}})
    with pytest.raises(InvalidInput, match="empty"):
        busy.import_(tmp_path / "export", manifest)
    assert busy.partitions() == ["mine"]

    shard = next(f.path for f in manifest.files if f.path.endswith(".safetensors"))
    data = bytearray((tmp_path / "export" / shard).read_bytes())
    data[-1] ^= 0x01
    (tmp_path / "export" / shard).write_bytes(bytes(data))
    fresh = planes()
    with pytest.raises(SnapshotCorrupt, match="sha256"):
        fresh.import_(tmp_path / "export", manifest)
    assert fresh.partitions() == []
    with pytest.raises(SchemaMismatch):
        fresh.import_(tmp_path / "export", manifest.model_copy(update={"backend": "somedb"}))


def test_storage_units_are_placed_by_a_custom_resource_that_must_exist() -> None:
    import ray

    from rollsafe.dataplane import tq_runtime
    from rollsafe.errors import DataPlaneUnavailable

    # This session's TransferQueue was started with no resource: its one unit is here.
    here = ray.get_runtime_context().get_node_id()
    assert tq_runtime.storage_unit_nodes() == {"TransferQueueStorageUnit#0": here}
    assert tq_runtime.controller_node() == here
    storage = tq_runtime.tq_config(2, "data_node")["backend"]["SimpleStorage"]
    assert storage == {"num_data_storage_units": 2, "required_node_resource": "data_node"}
    assert "required_node_resource" not in tq_runtime.tq_config()["backend"]["SimpleStorage"]
    # ParticipantRefused before tq.init, which would leave its named controller behind.
    with pytest.raises(DataPlaneUnavailable, match=r"'data_node'.*--resources"):
        tq_runtime.check_storage_resource("data_node")
    assert tq_runtime.nodes_with("CPU") == [here]
    tq_runtime.check_storage_resource("CPU")
    tq_runtime.check_storage_resource(None)
