"""Stateless sampling: the noise for generated position ``p`` is a pure function of (seed, p).

Engines usually seed one random generator per request at admission and draw from it token by
token; a call resumed at token ``n`` on a fresh engine then draws the wrong numbers. Here every
draw is computed from a counter: ``u[v] = hash(seed, p, v)`` for each vocabulary entry ``v``
(splitmix64 finalizers, 53-bit uniforms), and the token is chosen by Gumbel-max over the
nucleus. Nothing is carried from one position to the next, so any position can be the first.

No I/O: the same logits, seed and position give the same token and logprob bit for bit on any
machine with IEEE doubles. :func:`sample` (numpy, one row) is the definition; :func:`sample_rows`
is the same on a batch of rows in torch, for engines that sample a batch on its device.
"""

from __future__ import annotations

import numpy as np
import torch

from rollsafe.engine.protocol import SamplingParams

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix(x: np.ndarray) -> np.ndarray:
    # uint64 arithmetic wraps modulo 2**64 on arrays, which is what the finalizer needs.
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def uniforms(seed: int, position: int, size: int) -> np.ndarray:
    """``size`` uniforms in (0, 1) for (seed, position): the same numbers every time."""
    key = _splitmix(np.array([seed], dtype=np.uint64))
    key = _splitmix(key ^ (np.array([position], dtype=np.uint64) * _GOLDEN + _GOLDEN))
    counters = np.arange(1, size + 1, dtype=np.uint64) * _GOLDEN
    bits = _splitmix(key + counters) >> np.uint64(11)
    # (k + 0.5) / 2**53 is strictly inside (0, 1): log(-log u) is always finite.
    result: np.ndarray = (bits.astype(np.float64) + 0.5) * 2.0**-53
    return result


def _log_softmax(x: np.ndarray) -> np.ndarray:
    finite = x[np.isfinite(x)]
    top = finite.max()
    result: np.ndarray = x - (top + np.log(np.exp(finite - top).sum()))
    return result


def _nucleus(logprobs: np.ndarray, top_p: float) -> np.ndarray:
    """Mask (True = keep) of the smallest set of most likely tokens whose mass reaches top_p."""
    finite: np.ndarray = np.isfinite(logprobs)
    if top_p >= 1.0:
        return finite
    order = np.argsort(-logprobs, kind="stable")
    mass = np.cumsum(np.exp(logprobs[order]))
    keep_count = int(np.searchsorted(mass, top_p, side="left")) + 1
    keep = np.zeros(logprobs.shape, dtype=bool)
    keep[order[:keep_count]] = True
    keep &= finite
    return keep


def sample(logits: np.ndarray, params: SamplingParams, position: int) -> tuple[int, float]:
    """The token at generated position ``position`` and its logprob under the sampling
    distribution (``softmax(logits / temperature)``, before top-p; greedy reports T=1).

    ``logits`` is one row (vocabulary) of float32 scores.
    """
    scores = np.asarray(logits, dtype=np.float64).copy()
    if params.allowed_token_ids is not None:
        allowed = np.full(scores.shape, -np.inf)
        index = np.asarray(params.allowed_token_ids, dtype=np.int64)
        allowed[index] = scores[index]
        scores = allowed
    if params.temperature == 0.0:
        logprobs = _log_softmax(scores)
        token = int(np.argmax(scores))
        return token, float(np.float32(logprobs[token]))
    logprobs = _log_softmax(scores / params.temperature)
    keep = _nucleus(logprobs, params.top_p)
    gumbel = -np.log(-np.log(uniforms(params.seed, position, scores.size)))
    token = int(np.argmax(np.where(keep, logprobs + gumbel, -np.inf)))
    return token, float(np.float32(logprobs[token]))


# -- the same definition on a batch of rows, in torch (on the logits' device) ----------------
# vLLM's sampler hook (rollsafe.engine.vllm.sampler) samples a whole batch at once, where the
# logits live (a GPU, in production). Integer hashing in int64 has the same bits as the uint64
# arithmetic above (torch has no uint64 multiply; shifts are made logical by masking), so the
# uniforms are identical, and the float work is the same float64 steps: tests/unit/
# test_sampling.py checks token and logprob equal to :func:`sample` row by row.


def _as_int64(constant: np.uint64) -> int:
    """A uint64 constant as the int64 with the same bits."""
    value = int(constant)
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)  # logical, not torch's arithmetic shift


def _splitmix_rows(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shift_right(x, 30)) * _as_int64(_MIX1)
    x = (x ^ _shift_right(x, 27)) * _as_int64(_MIX2)
    return x ^ _shift_right(x, 31)


def uniforms_rows(seeds: torch.Tensor, positions: torch.Tensor, size: int) -> torch.Tensor:
    """``[rows, size]`` float64: row ``i`` is ``uniforms(seeds[i], positions[i], size)``."""
    golden = _as_int64(_GOLDEN)
    key = _splitmix_rows(seeds.to(torch.int64))
    key = _splitmix_rows(key ^ (positions.to(torch.int64) * golden + golden))
    counters = torch.arange(1, size + 1, dtype=torch.int64, device=seeds.device) * golden
    bits = _shift_right(_splitmix_rows(key[:, None] + counters[None, :]), 11)
    return (bits.to(torch.float64) + 0.5) * 2.0**-53


def sample_rows(
    logits: torch.Tensor,
    *,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample` for each row of ``logits`` ``[rows, vocab]``: the tokens (int64) and
    their logprobs (float32). ``allowed``: an optional ``[rows, vocab]`` mask."""
    scores = logits.to(torch.float64)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    greedy = temperatures == 0
    divisor = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    logprobs = torch.log_softmax(scores / divisor.to(torch.float64)[:, None], dim=-1)
    ordered, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    mass = torch.cumsum(ordered.exp(), dim=-1)
    wanted = top_ps.to(torch.float64)[:, None].contiguous()
    keep_count = torch.searchsorted(mass, wanted, right=False) + 1
    ranks = torch.arange(scores.shape[-1], device=scores.device)[None, :]
    keep = torch.zeros_like(ranks < keep_count).scatter(-1, order, ranks < keep_count)
    keep = (keep | (top_ps >= 1.0)[:, None]) & torch.isfinite(logprobs)
    gumbel = -torch.log(-torch.log(uniforms_rows(seeds, positions, scores.shape[-1])))
    noisy = torch.where(keep, logprobs + gumbel, float("-inf"))
    tokens = torch.where(greedy, scores.argmax(dim=-1), noisy.argmax(dim=-1))
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0].to(torch.float32)
