"""Policy weights on the wire: the trainer pushes a new version to an engine server.

The body is a safetensors file made by the ``safetensors`` library itself (no pickle: a weights
upload cannot run code on the engine), one tensor per parameter name, in the dtype the trainer
holds: float32, bfloat16 (which numpy has no type for) or float16. Its metadata names the
format, so a body that is some other safetensors file is refused by name.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from rollsafe.errors import InvalidInput

FORMAT = {"format": "rollsafe-weights", "format_version": "1"}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@runtime_checkable
class WeightUpdatable(Protocol):
    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None: ...


def encode_weights(weights: Mapping[str, torch.Tensor]) -> bytes:
    tensors = {name: t.detach().cpu().contiguous() for name, t in weights.items()}
    for name, tensor in tensors.items():
        if tensor.dtype not in _FLOATS:
            raise InvalidInput(f"weight {name}: {tensor.dtype} is not float32/bfloat16/float16")
    return save(tensors, metadata=FORMAT)


def decode_weights(body: bytes) -> dict[str, torch.Tensor]:
    """The tensors of an upload; :class:`InvalidInput` naming the problem when it is not one."""
    try:
        tensors = load(body)
        metadata = _metadata(body)
    except (SafetensorError, ValueError) as exc:
        raise InvalidInput(f"weights upload is not a safetensors file: {exc}") from None
    if metadata != FORMAT:
        raise InvalidInput(f"weights upload has metadata {metadata}, want {FORMAT}")
    for name, tensor in tensors.items():
        if tensor.dtype not in _FLOATS:
            raise InvalidInput(f"weights upload: {name} is {tensor.dtype}, not a float dtype")
    return tensors


def _metadata(body: bytes) -> dict[str, str] | None:
    """The header's ``__metadata__`` (``load`` has checked the header)."""
    (length,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + length])
    metadata: dict[str, str] | None = header.get("__metadata__")
    return metadata
