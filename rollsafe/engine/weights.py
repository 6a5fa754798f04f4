"""Policy weights on the wire: the trainer pushes a new version to an engine server.

The body is the safetensors layout written by :mod:`rollsafe.tensorfile` (no pickle: a
weights upload cannot run code on the engine), one float tensor per parameter name.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from rollsafe.errors import InvalidInput, SnapshotCorrupt
from rollsafe.tensorfile import HashingWriter, read_tensors, write_tensors


@runtime_checkable
class WeightUpdatable(Protocol):
    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None: ...


def encode_weights(weights: Mapping[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    arrays = {name: t.detach().cpu().contiguous().numpy() for name, t in weights.items()}
    write_tensors(HashingWriter(buffer), arrays)
    return buffer.getvalue()


def decode_weights(body: bytes) -> dict[str, torch.Tensor]:
    try:
        arrays, _ = read_tensors(body, "weights upload")
    except SnapshotCorrupt as exc:  # a bad upload is the caller's input, not our state
        raise InvalidInput(str(exc)) from None
    # A copy: the tensors must not keep the request body alive, and must be writable.
    return {name: torch.from_numpy(np.array(array)) for name, array in arrays.items()}
