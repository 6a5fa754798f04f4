import io
import json
import re
import struct
from collections.abc import Callable, Mapping

import numpy as np
import pytest
import safetensors.numpy
from safetensors import SafetensorError

from rollsafe.errors import SnapshotCorrupt
from rollsafe.snapshot.tensorfile import HashingWriter, read_tensors, write_tensors

ARRAYS: dict[str, np.ndarray] = {
    "ids": np.arange(10, dtype=np.int64),
    "digests": np.arange(64, dtype=np.uint8).reshape(2, 32),
    "scalar": np.array(1.5, dtype=np.float32),
    "empty": np.zeros((0, 3), dtype=np.int32),
    "flags": np.array([True, False]),
}


def encode(
    arrays: Mapping[str, np.ndarray] = ARRAYS, metadata: Mapping[str, str] | None = None
) -> tuple[bytes, HashingWriter]:
    buffer = io.BytesIO()
    writer = HashingWriter(buffer)
    write_tensors(writer, arrays, metadata)
    return buffer.getvalue(), writer


def test_round_trip_keeps_dtype_shape_and_bytes() -> None:
    data, writer = encode(metadata={"format": "x"})
    arrays, metadata = read_tensors(data, "t")
    assert metadata == {"format": "x"}
    for name, array in ARRAYS.items():
        assert arrays[name].dtype == array.dtype and arrays[name].shape == array.shape
        assert arrays[name].tobytes() == array.tobytes()
    assert writer.size == len(data)


def test_the_safetensors_library_reads_our_files() -> None:
    data, _ = encode()
    loaded = safetensors.numpy.load(data)
    assert set(loaded) == set(ARRAYS)
    assert all(np.array_equal(loaded[k], ARRAYS[k]) for k in ARRAYS)


def test_writer_hash_matches_the_bytes() -> None:
    import hashlib

    data, writer = encode()
    assert writer.hexdigest() == hashlib.sha256(data).hexdigest()


def test_non_contiguous_and_big_endian_inputs_are_written_correctly() -> None:
    arrays = {"t": np.arange(12, dtype=">i4").reshape(3, 4).T}
    data, _ = encode(arrays)
    back, _ = read_tensors(data, "t")
    assert np.array_equal(back["t"], arrays["t"])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d[:4], "truncated"),
        (lambda d: d[:-1], "does not fit"),
        (lambda d: d + b"x", "body is"),
        (lambda d: struct.pack("<Q", 1 << 40) + d[8:], "invalid header length"),
        (lambda d: d[:8] + b"[" + d[9:], "unreadable header"),
    ],
)
def test_damage_is_snapshot_corrupt_naming_the_source(
    mutate: Callable[[bytes], bytes], message: str
) -> None:
    data, _ = encode()
    with pytest.raises(SnapshotCorrupt, match=f"src: .*{message}"):
        read_tensors(mutate(data), "src")


def test_unknown_dtype_is_refused() -> None:
    data, _ = encode({"x": np.zeros(2, dtype=np.int32)})
    damaged = data.replace(b'"I32"', b'"Q99"')
    with pytest.raises(SnapshotCorrupt, match="bad header entry for 'x'"):
        read_tensors(damaged, "src")


def crafted(entries: dict[str, tuple[str, list[int], int, int]], body: bytes) -> bytes:
    """A safetensors file built byte by byte: name -> (dtype, shape, begin, end), then
    ``body`` (not the writer: it cannot produce these layouts)."""
    header = {
        name: {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        for name, (dtype, shape, begin, end) in entries.items()
    }
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + body


def refused(data: bytes, message: str) -> None:
    """read_tensors raises naming ``message`` (so returns nothing); safetensors refuses too."""
    with pytest.raises(SnapshotCorrupt, match=f"^src: {re.escape(message)}$"):
        read_tensors(data, "src")
    with pytest.raises(SafetensorError, match="invalid offset"):
        safetensors.numpy.load(data)


@pytest.mark.parametrize(
    ("entries", "size", "message"),
    [
        (
            {"a": ("U8", [4], 0, 4), "b": ("U8", [4], 2, 6)},
            6,
            "tensors 'a' at 0..4 and 'b' at 2..6 overlap",
        ),
        (  # the same bytes twice: each tensor on its own fits the body
            {"a": ("I32", [2], 0, 8), "b": ("U8", [8], 0, 8)},
            8,
            "tensors 'a' at 0..8 and 'b' at 0..8 overlap",
        ),
        (  # listed out of offset order in the header
            {"late": ("U8", [4], 4, 8), "early": ("U8", [6], 0, 6)},
            8,
            "tensors 'early' at 0..6 and 'late' at 4..8 overlap",
        ),
        (  # an empty tensor inside another: safetensors refuses it as well
            {"a": ("U8", [8], 0, 8), "b": ("U8", [0], 4, 4)},
            8,
            "tensors 'a' at 0..8 and 'b' at 4..4 overlap",
        ),
    ],
    ids=["partial", "identical", "out-of-order", "empty-inside"],
)
def test_overlapping_tensors_are_refused_naming_both(
    entries: dict[str, tuple[str, list[int], int, int]], size: int, message: str
) -> None:
    refused(crafted(entries, bytes(size)), message)


@pytest.mark.parametrize(
    ("entries", "size", "message"),
    [
        (
            {"a": ("U8", [4], 0, 4), "b": ("U8", [4], 6, 10)},
            10,
            "gap of 2 bytes before 'b' at 6..10 (after 'a' at 0..4)",
        ),
        (
            {"a": ("U8", [4], 2, 6)},
            6,
            "gap of 2 bytes before 'a' at 2..6 (the body starts at 0)",
        ),
    ],
    ids=["between", "leading"],
)
def test_a_gap_between_tensors_is_refused(
    entries: dict[str, tuple[str, list[int], int, int]], size: int, message: str
) -> None:
    refused(crafted(entries, bytes(size)), message)


def test_an_empty_tensor_may_share_its_offset_with_its_neighbours() -> None:
    data = crafted(
        {"a": ("U8", [0], 0, 0), "b": ("U8", [4], 0, 4), "c": ("I8", [0], 4, 4)}, b"abcd"
    )
    arrays, _ = read_tensors(data, "src")
    assert arrays["b"].tobytes() == b"abcd" and arrays["a"].size == arrays["c"].size == 0
    assert set(safetensors.numpy.load(data)) == {"a", "b", "c"}


@pytest.mark.parametrize(
    ("shape", "offsets", "message"),
    [
        ([-2, -2], [0, 16], "bad header entry for 'x'"),  # numpy would infer -1 dimensions
        ([4], ["0", "16"], "bad header entry for 'x'"),
        ([4.0], [0, 16], "bad header entry for 'x'"),
        ([1 << 32, 1 << 32], [0, 0], "'x' byte range 0..0 does not fit"),  # 2**64 wraps to 0
    ],
    ids=["negative-dims", "string-offsets", "float-dim", "product-past-int64"],
)
def test_shapes_and_offsets_must_be_non_negative_integers(
    shape: list[int] | list[float], offsets: list[int] | list[str], message: str
) -> None:
    header = json.dumps({"x": {"dtype": "I32", "shape": shape, "data_offsets": offsets}})
    data = struct.pack("<Q", len(header)) + header.encode() + bytes(16)
    with pytest.raises(SnapshotCorrupt, match=f"^src: {re.escape(message)}$"):
        read_tensors(data, "src")
    with pytest.raises(SafetensorError):
        safetensors.numpy.load(data)
