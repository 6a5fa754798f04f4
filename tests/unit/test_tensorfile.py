import io
import struct

import numpy as np
import pytest
import safetensors.numpy

from rollsafe.errors import SnapshotCorrupt
from rollsafe.snapshot.tensorfile import HashingWriter, read_tensors, write_tensors

ARRAYS = {
    "ids": np.arange(10, dtype=np.int64),
    "digests": np.arange(64, dtype=np.uint8).reshape(2, 32),
    "scalar": np.array(1.5, dtype=np.float32),
    "empty": np.zeros((0, 3), dtype=np.int32),
    "flags": np.array([True, False]),
}


def encode(arrays=ARRAYS, metadata=None) -> tuple[bytes, HashingWriter]:
    buffer = io.BytesIO()
    writer = HashingWriter(buffer)
    write_tensors(writer, arrays, metadata)
    return buffer.getvalue(), writer


def test_round_trip_keeps_dtype_shape_and_bytes():
    data, writer = encode(metadata={"format": "x"})
    arrays, metadata = read_tensors(data, "t")
    assert metadata == {"format": "x"}
    for name, array in ARRAYS.items():
        assert arrays[name].dtype == array.dtype and arrays[name].shape == array.shape
        assert arrays[name].tobytes() == array.tobytes()
    assert writer.size == len(data)


def test_the_safetensors_library_reads_our_files():
    data, _ = encode()
    loaded = safetensors.numpy.load(data)
    assert set(loaded) == set(ARRAYS)
    assert all(np.array_equal(loaded[k], ARRAYS[k]) for k in ARRAYS)


def test_writer_hash_matches_the_bytes():
    import hashlib

    data, writer = encode()
    assert writer.hexdigest() == hashlib.sha256(data).hexdigest()


def test_non_contiguous_and_big_endian_inputs_are_written_correctly():
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
def test_damage_is_snapshot_corrupt_naming_the_source(mutate, message):
    data, _ = encode()
    with pytest.raises(SnapshotCorrupt, match=f"src: .*{message}"):
        read_tensors(mutate(data), "src")


def test_unknown_dtype_is_refused():
    data, _ = encode({"x": np.zeros(2, dtype=np.int32)})
    damaged = data.replace(b'"I32"', b'"Q99"')
    with pytest.raises(SnapshotCorrupt, match="bad header entry for 'x'"):
        read_tensors(damaged, "src")
