"""Prefix records: digest, the checks a resume makes, and staging through the data plane."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pydantic import ValidationError

from rollsafe.dataplane.memory import MemoryDataPlane
from rollsafe.engine.protocol import (
    GenerateRequest,
    PrefixRecord,
    SamplingParams,
    prompt_digest,
    seal_prefix,
)
from rollsafe.engine.staging import (
    PREFIX_PARTITION,
    PrefixReader,
    load_prefixes,
    prefix_key,
    record_to_row,
    stage_prefixes,
)
from rollsafe.errors import DataPlaneKeyMissing, PrefixMismatch

MODEL = "ab" * 32
SAMPLING = SamplingParams(seed=3, temperature=0.9, max_tokens=16)


def request(call_id: str = "c1") -> GenerateRequest:
    return GenerateRequest(call_id=call_id, prompt_tokens=(4, 5, 6), sampling=SAMPLING)


def record(call_id: str = "c1", *, routes: bool = True, n: int = 3) -> PrefixRecord:
    return seal_prefix(
        call_id=call_id,
        model=MODEL,
        prompt_digest=prompt_digest((4, 5, 6)),
        sampling=SAMPLING,
        tokens=tuple(range(10, 10 + n)),
        logprobs=tuple(float(np.float32(-0.1 * (i + 1))) for i in range(n)),
        weight_versions=(0,) * (n - 1) + (1,),
        routes=tuple(((i % 4, 1), (2, 3)) for i in range(n)) if routes else None,
    )


def test_a_sealed_record_verifies_and_survives_json() -> None:
    sealed = record()
    sealed.verify()
    again = PrefixRecord.model_validate_json(sealed.model_dump_json())
    assert again == sealed
    again.verify()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tokens", (10, 11, 99)),
        ("logprobs", (-0.1, -0.2, -0.31)),
        ("weight_versions", (0, 0, 0)),
        ("routes", (((0, 1), (2, 3)),) * 3),
        ("call_id", "c2"),
        ("prompt_digest", "cd" * 32),
    ],
)
def test_any_changed_field_breaks_the_digest(field: str, value: object) -> None:
    tampered = record().model_copy(update={field: value})
    with pytest.raises(PrefixMismatch, match="digest"):
        tampered.verify()


def test_check_request_names_what_does_not_match() -> None:
    sealed = record()
    sealed.check_request(request(), MODEL)
    cases = {
        "call_id": (request("other"), MODEL),
        "model": (request(), "cd" * 32),
        "prompt_digest": (request().model_copy(update={"prompt_tokens": (4, 5)}), MODEL),
        "sampling": (
            request().model_copy(update={"sampling": SAMPLING.model_copy(update={"top_p": 0.5})}),
            MODEL,
        ),
    }
    for field, (asked, model) in cases.items():
        with pytest.raises(PrefixMismatch) as caught:
            sealed.check_request(asked, model)
        assert caught.value.field == field


def test_misaligned_or_oversized_records_are_refused() -> None:
    fields = record().model_dump()
    with pytest.raises(ValidationError, match="logprobs has 2 entries for 3 tokens"):
        PrefixRecord.model_validate({**fields, "logprobs": (-1.0, -2.0)})
    with pytest.raises(ValidationError, match="routes has 1 entries"):
        PrefixRecord.model_validate({**fields, "routes": (((0, 1), (2, 3)),)})
    with pytest.raises(ValidationError, match="exceed max_tokens"):
        record(n=17)
    with pytest.raises(ValidationError, match="extra"):
        PrefixRecord.model_validate({**fields, "kv_cache": []})


class CountingDataPlane(MemoryDataPlane):
    def __init__(self) -> None:
        super().__init__()
        self.puts: list[int] = []

    def put(self, partition: str, rows):  # type: ignore[no-untyped-def]
        self.puts.append(len(rows))
        super().put(partition, rows)


def test_staging_round_trips_in_batches_and_typed_arrays() -> None:
    records = [record(f"c{i}", routes=i % 2 == 0) for i in range(150)]
    dataplane = CountingDataPlane()
    keys = stage_prefixes(dataplane, records)
    assert dataplane.puts == [64, 64, 22]
    assert keys[0] == prefix_key("c0")
    row = dataplane.get(PREFIX_PARTITION, [keys[0]])[keys[0]]
    assert row["tokens"].dtype == np.int64 and row["routes"].shape == (3, 2, 2)
    loaded = load_prefixes(dataplane, [r.call_id for r in records])
    assert [loaded[r.call_id] for r in records] == records


def test_a_changed_row_in_storage_is_a_prefix_mismatch_not_a_resume() -> None:
    dataplane = MemoryDataPlane()
    sealed = record()
    row = record_to_row(sealed)
    row["tokens"] = row["tokens"].copy()
    row["tokens"][1] = 77
    dataplane.put(PREFIX_PARTITION, {prefix_key("c1"): row})
    with pytest.raises(PrefixMismatch, match="c1: prefix digest mismatch"):
        load_prefixes(dataplane, ["c1"])
    dataplane.put(PREFIX_PARTITION, {prefix_key("c2"): {"tokens": np.zeros(1, np.int64)}})
    with pytest.raises(PrefixMismatch, match="c2: prefix row mismatch: unreadable row"):
        load_prefixes(dataplane, ["c2"])


def test_a_call_with_nothing_staged_is_named() -> None:
    dataplane = MemoryDataPlane()
    stage_prefixes(dataplane, [record("c1")])
    with pytest.raises(DataPlaneKeyMissing, match="prefix/c9"):
        load_prefixes(dataplane, ["c1", "c9"])


async def test_prefix_reader_coalesces_resumers_and_verifies_each_record() -> None:
    dataplane = MemoryDataPlane()
    records = [record(f"c{i}", n=2 + i % 5) for i in range(40)]
    stage_prefixes(dataplane, records)
    reader = PrefixReader(dataplane, window_s=0.01)
    got = await asyncio.gather(*(reader.read(r.call_id) for r in records))
    assert got == records
    assert reader.batcher.stats.reads == 1
    with pytest.raises(DataPlaneKeyMissing, match="prefix/gone"):
        await reader.read("gone")
