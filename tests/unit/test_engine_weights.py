"""Weights on the wire (rollsafe.engine.weights): every float dtype a trainer holds goes
through bit for bit, bfloat16 included; anything else is refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save

from rollsafe.engine.weights import FORMAT, decode_weights, encode_weights
from rollsafe.errors import InvalidInput


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weights_round_trip_bit_for_bit(dtype: torch.dtype) -> None:
    weights = {"layer.weight": torch.randn(3, 5).to(dtype), "head": torch.randn(7).to(dtype)}
    back = decode_weights(encode_weights(weights))
    assert back.keys() == weights.keys()
    for name, tensor in weights.items():
        assert back[name].dtype == dtype and torch.equal(back[name], tensor)


def test_bad_uploads_are_refused_by_name() -> None:
    body = encode_weights({"w": torch.zeros(4)})
    for bad, problem in (
        (b"not weights", "not a safetensors file"),
        (body[:-2], "not a safetensors file"),
        (save({"w": torch.zeros(4)}), "metadata None"),
        (save({"w": torch.zeros(4, dtype=torch.int64)}, metadata=FORMAT), "not a float"),
    ):
        with pytest.raises(InvalidInput, match=problem):
            decode_weights(bad)
    with pytest.raises(InvalidInput, match="is not float32/bfloat16/float16"):
        encode_weights({"w": torch.zeros(2, dtype=torch.int32)})
