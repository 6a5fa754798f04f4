"""Capturing a TransferQueue data plane while a writer hammers it, and coalesced prefix reads
through a storage outage, on a real Ray and TransferQueue (the session's)."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollsafe.checkpoint.controller import Controller
from rollsafe.core.config import RunConfig
from rollsafe.core.phases import PHASES, PhaseRequest, SnapshotSpec
from rollsafe.core.run_state import ROLLOUT_PARTITION
from rollsafe.dataplane.protocol import row_digest
from rollsafe.dataplane.tq_runtime import import_tq
from rollsafe.dataplane.transferqueue import TransferQueueDataPlane
from rollsafe.engine.protocol import SamplingParams, prompt_digest, seal_prefix
from rollsafe.engine.staging import PrefixReader, prefix_key, stage_prefixes
from rollsafe.errors import DataPlaneKeyMissing
from rollsafe.snapshot import SnapshotManifest, SnapshotStore, state_files

pytestmark = pytest.mark.usefixtures("transferqueue")

RUN = "hammered"
SNAPSHOTS = 4


def rollout_row(idx: int, i: int, attempt: int) -> dict[str, np.ndarray]:
    seed = hashlib.sha256(f"{idx}/{i}/{attempt}".encode()).digest()
    tokens = np.random.default_rng(int.from_bytes(seed[:8], "little")).integers(
        0, 50_000, 1_000, dtype=np.int32
    )
    return {"tokens": tokens, "logprobs": -(tokens.astype(np.float32) / 50_000.0)}


class Writer(threading.Thread):
    """The run's own write path, as fast as it goes: hand out groups and dispatch them while
    the gate is open, seal a backlog of dispatched rollouts (sealing goes on while the gate is
    closed, as in-flight episodes do), and commit steps that delete trained rows."""

    def __init__(self, service: Controller) -> None:
        super().__init__(daemon=True)
        self.service = service
        self.stop = threading.Event()
        self.sealed: dict[str, bytes] = {}  # key -> digest of every row this writer sealed
        self.seals = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            self.error = exc

    def _loop(self) -> None:
        backlog: list[tuple[int, int, int]] = []
        group, step = 0, 0
        while not self.stop.is_set():
            if len(backlog) < 16:
                self.service.handout([group])
                for i in range(2):
                    if (episode := self.service.dispatch(group, i)) is not None:
                        backlog.append((group, i, episode.attempt))
                group += 1
            if backlog:
                idx, i, attempt = backlog.pop(0)
                row = rollout_row(idx, i, attempt)
                if self.service.seal(idx, i, attempt, row):
                    self.sealed[self.service.state.row_key(idx, i)] = row_digest(row)
                    self.seals += 1
            if self.seals and self.seals % 25 == 0 and (ready := self.service.select()):
                self.service.claim(ready, step)
                self.service.commit_step(ready)
                step += 1


@pytest.fixture
def hammered(tmp_path: Path) -> Iterator[tuple[Controller, Writer, list[int]]]:
    # The writer must outpace the phases: without the journal's durable waits (its own tests
    # hammer it: test_journal_*), the capture's consistency is the barrier's alone.
    config = RunConfig(run_id=RUN, group_size=2, groups_per_step=2, journal=False)
    service = Controller(config, tmp_path, dataplane="transferqueue", keep_latest_k=10)
    writer = Writer(service)
    seals_inside: list[int] = []
    writer.start()
    try:
        for seq in range(1, SNAPSHOTS + 1):
            while writer.seals < 40 * seq and writer.is_alive():
                threading.Event().wait(0.01)
            before = writer.seals
            spec = SnapshotSpec(run_id=RUN, seq=seq)
            for phase in PHASES:
                service.run_phase(PhaseRequest(spec=spec, phase=phase))
            seals_inside.append(writer.seals - before)
    finally:
        writer.stop.set()
        writer.join(timeout=30)
    try:
        yield service, writer, seals_inside
    finally:
        service.state.dataplane.clear()


def test_capture_under_a_hammering_writer_restores_every_row_intact(
    hammered: tuple[Controller, Writer, list[int]],
) -> None:
    service, writer, seals_inside = hammered
    assert writer.error is None, writer.error
    # The writer really wrote while each snapshot ran (phases other than capture leave the
    # barrier open), so the capture's consistency is the barrier's doing, not an idle run's.
    assert all(count > 0 for count in seals_inside), seals_inside
    published = service.store.list()
    assert len(published) == SNAPSHOTS
    for entry in published:

        def accept(m: SnapshotManifest, seq: int | None = entry.seq) -> str | None:
            return None if m.seq == seq else "not this one"

        plane = TransferQueueDataPlane()  # a clean namespace, as after a crash
        try:
            restored, _ = state_files.restore(
                service.state.config, service.store, plane, accept=accept
            )
            sealed = {
                restored.row_key(idx, i): (idx, i)
                for idx in restored.ledger.groups()
                for i in restored.ledger.sealed(idx)
            }
            # None missing, none extra, none torn: each row is the one the writer sealed.
            assert set(plane.list(ROLLOUT_PARTITION)) == set(sealed)
            assert sealed, "the snapshot captured no sealed rows"
            rows = plane.get(ROLLOUT_PARTITION, sorted(sealed))
            for key, (idx, i) in sealed.items():
                digest = row_digest(rows[key])
                assert restored.ledger.sealed_row_matches(idx, i, digest)
                assert writer.sealed[key] == digest
        finally:
            plane.clear()


class CountingPlane:
    """A TransferQueue plane whose reads are counted (the batcher's cost, measured outside it)."""

    def __init__(self, plane: TransferQueueDataPlane) -> None:
        self.plane = plane
        self.reads: list[int] = []

    def get(self, partition: str, keys: Any) -> Any:
        keys = list(keys)
        self.reads.append(len(keys))
        return self.plane.get(partition, keys)


def prefix(call_id: str, n: int) -> Any:
    return seal_prefix(
        call_id=call_id,
        model="ab" * 32,
        prompt_digest=prompt_digest((1, 2, 3)),
        sampling=SamplingParams(seed=5, max_tokens=64),
        tokens=tuple(range(n)),
        logprobs=tuple(-0.5 for _ in range(n)),
        weight_versions=(0,) * n,
        routes=tuple(((j % 4, (j + 1) % 4),) for j in range(n)),
    )


def test_a_storage_outage_costs_n_plus_one_reads_and_fails_only_its_callers() -> None:
    plane = TransferQueueDataPlane()
    try:
        records = [prefix(f"call-{i}", 1 + i % 7) for i in range(40)]
        stage_prefixes(plane, records)
        lost = [records[3].call_id, records[17].call_id, records[31].call_id]
        # The storage unit loses three rows the controller still lists (an outage of part of
        # the storage): TransferQueue then fails the whole multi-key read.
        client = import_tq().get_client()
        meta = client.kv_retrieve_meta(
            keys=[prefix_key(c) for c in lost], partition_id=f"{plane.namespace}/prefixes"
        )
        client._run_coroutine(client.storage_manager.clear_data(meta))

        counting = CountingPlane(plane)
        reader = PrefixReader(counting, window_s=0.05)  # type: ignore[arg-type]

        async def resume_all() -> list[Any]:
            reads = (reader.read(r.call_id) for r in records)
            return await asyncio.gather(*reads, return_exceptions=True)

        results = asyncio.run(resume_all())
        assert counting.reads == [40] + [1] * 40  # N + 1, not 2N - 1
        for record, result in zip(records, results, strict=True):
            if record.call_id in lost:
                assert isinstance(result, DataPlaneKeyMissing)
                assert result.missing == [prefix_key(record.call_id)]
            else:
                assert result == record
    finally:
        plane.clear()


def test_scenario_cli_runs_on_transferqueue_and_agrees_with_memory(tmp_path: Path) -> None:
    """The CLI starts its own Ray and TransferQueue (RAY_ADDRESS unset) and stops them."""
    scenario = Path(__file__).parent.parent / "scenarios" / "s4_two_batches_in_flight.json"
    outputs = {}
    for backend in ("memory", "transferqueue"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "rollsafe",
                "scenario",
                "run",
                str(scenario),
                "--dataplane",
                backend,
            ],
            capture_output=True,
            text=True,
            timeout=180,
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        outputs[backend] = done.stdout
    assert outputs["transferqueue"] == outputs["memory"]


def test_a_controller_actor_keeps_its_rows_in_transferqueue(
    ray_session: Any, tmp_path: Path
) -> None:
    """The controller runs in its own Ray worker process and attaches to the driver's
    TransferQueue; its snapshot restores here, in another process, into a clean namespace."""
    from rollsafe.checkpoint.actor import start_controller_actor
    from rollsafe.evidence.scenario import row_content

    ray, run_id = ray_session, "tq-actor"
    config = RunConfig(run_id=run_id, group_size=2, groups_per_step=2)
    actor = start_controller_actor(run_id, config, tmp_path, dataplane="transferqueue")
    try:
        ray.get(actor.handout.remote([0, 1]))
        for idx, i in [(0, 0), (0, 1), (1, 0)]:
            episode = ray.get(actor.dispatch.remote(idx, i))
            ray.get(actor.seal.remote(idx, i, episode.attempt, row_content(idx, i, 0)))
        spec = SnapshotSpec(run_id=run_id, seq=1)
        for phase in PHASES:
            ray.get(actor.run_phase.remote(PhaseRequest(spec=spec, phase=phase)))
        backend = ray.get(actor.__ray_call__.remote(lambda service: service.state.dataplane.name))
        assert backend == "transferqueue"
    finally:
        ray.get(actor.__ray_call__.remote(lambda service: service.state.dataplane.clear()))
        ray.kill(actor)
    plane = TransferQueueDataPlane()
    try:
        restored, plan = state_files.restore(config, SnapshotStore(tmp_path, run_id), plane)
        assert plan.ready == [0] and sorted(plan.partial) == [1]
        rows = plane.get(ROLLOUT_PARTITION, [restored.row_key(0, 0), restored.row_key(1, 0)])
        assert row_digest(rows[restored.row_key(1, 0)]) == row_digest(row_content(1, 0, 0))
    finally:
        plane.clear()
