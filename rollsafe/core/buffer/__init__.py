"""Replay buffer: the replay index of owned groups and the samplers that pick training groups."""

from rollsafe.core.buffer.index import ReplayIndex
from rollsafe.core.buffer.samplers import (
    SAMPLERS,
    InOrderSampler,
    Sampler,
    SamplerState,
    WeightFifoSampler,
    WindowedSampler,
    make_sampler,
)

__all__ = [
    "SAMPLERS",
    "InOrderSampler",
    "ReplayIndex",
    "Sampler",
    "SamplerState",
    "WeightFifoSampler",
    "WindowedSampler",
    "make_sampler",
]
