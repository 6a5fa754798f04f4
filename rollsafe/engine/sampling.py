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


def _splitmix_(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer, in place (uint64 arrays wrap modulo 2**64, as it needs)."""
    shifted = np.empty_like(x)
    for shift, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
        np.right_shift(x, np.uint64(shift), out=shifted)
        x ^= shifted
        if multiplier is not None:
            x *= multiplier
    return x


def uniforms_of_rows(seeds: np.ndarray, positions: np.ndarray, size: int) -> np.ndarray:
    """``[rows, size]`` uniforms in (0, 1): row ``i`` for ``(seeds[i], positions[i])``."""
    key = _splitmix_(np.asarray(seeds).astype(np.uint64))
    key = _splitmix_(key ^ (np.asarray(positions).astype(np.uint64) * _GOLDEN + _GOLDEN))
    bits = _splitmix_(key[:, None] + np.arange(1, size + 1, dtype=np.uint64) * _GOLDEN)
    bits >>= np.uint64(11)
    # (k + 0.5) / 2**53 is strictly inside (0, 1): log(-log u) is always finite.
    result = bits.astype(np.float64)
    result += 0.5
    result *= 2.0**-53
    return result


def uniforms(seed: int, position: int, size: int) -> np.ndarray:
    """``size`` uniforms in (0, 1) for (seed, position): the same numbers every time."""
    row: np.ndarray = uniforms_of_rows(np.array([seed]), np.array([position]), size)[0]
    return row


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
# logits live (a GPU, in production). On a GPU the hash runs in int64, with the same bits as
# the uint64 arithmetic above (torch has no uint64 multiply; shifts are made logical by
# masking); on the CPU numpy runs it. The float work is the same float64 steps:
# tests/unit/test_engine_sampling.py checks uniforms, tokens and logprobs equal to
# :func:`uniforms` and :func:`sample` row by row, on both hash paths.


def _as_int64(constant: np.uint64) -> int:
    """A uint64 constant as the int64 with the same bits."""
    value = int(constant)
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)  # logical, not torch's arithmetic shift


def _splitmix_rows_(x: torch.Tensor) -> torch.Tensor:
    """The finalizer on int64, in place: the hash works on ``rows x vocab`` ints, and each
    fresh tensor an out-of-place step would allocate costs a pass over memory."""
    x ^= _shift_right(x, 30)
    x *= _as_int64(_MIX1)
    x ^= _shift_right(x, 27)
    x *= _as_int64(_MIX2)
    x ^= _shift_right(x, 31)
    return x


def uniforms_rows(seeds: torch.Tensor, positions: torch.Tensor, size: int) -> torch.Tensor:
    """``[rows, size]`` float64: row ``i`` is ``uniforms(seeds[i], positions[i], size)``, on
    the seeds' device. On the CPU numpy computes them (its uint64 shifts are logical: half the
    passes of int64 with masks, measured 0.3 against 0.67 ms for 32 x 1,024)."""
    if seeds.device.type == "cpu":
        return torch.from_numpy(uniforms_of_rows(seeds.numpy(), positions.numpy(), size))
    return uniforms_rows_torch(seeds, positions, size)


def uniforms_rows_torch(seeds: torch.Tensor, positions: torch.Tensor, size: int) -> torch.Tensor:
    """:func:`uniforms_rows` in torch alone, for a device numpy cannot reach (a GPU)."""
    golden = _as_int64(_GOLDEN)
    key = _splitmix_rows_(seeds.to(torch.int64).clone())
    key = _splitmix_rows_(key ^ (positions.to(torch.int64) * golden + golden))
    counters = torch.arange(1, size + 1, dtype=torch.int64, device=seeds.device) * golden
    bits = _splitmix_rows_(key[:, None] + counters[None, :])
    return _shift_right(bits, 11).to(torch.float64).add_(0.5).mul_(2.0**-53)


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
    their logprobs (float32). ``allowed``: an optional ``[rows, vocab]`` mask.

    Work no row needs is skipped, each skip exact: the nucleus sort when no row has
    ``top_p < 1``, the division when every temperature is 1 (``x / 1.0 == x``), the noise when
    every row is greedy, the greedy argmax when no row is, and the mask of non-finite logprobs
    when no nucleus is drawn (``-inf`` plus finite noise stays ``-inf``). A NaN or ``+inf``
    logit (a broken model) is the one input where this and :func:`sample` may differ."""
    scores = logits.to(torch.float64)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))  # not in place: may be logits
    greedy = temperatures == 0
    scaled = scores
    if not bool((temperatures[~greedy] == 1.0).all()):
        divisor = torch.where(greedy, torch.ones_like(temperatures), temperatures)
        scaled = scores / divisor.to(torch.float64)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    if bool(greedy.all()):
        tokens = scores.argmax(dim=-1)
    else:
        noisy = uniforms_rows(seeds, positions, scores.shape[-1]).log_().neg_().log_().neg_()
        noisy.add_(logprobs)
        if (kept := _nucleus_rows(logprobs, top_ps)) is not None:
            noisy.masked_fill_(~kept, float("-inf"))
        tokens = noisy.argmax(dim=-1)
        if bool(greedy.any()):
            tokens = torch.where(greedy, scores.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0].to(torch.float32)


def _nucleus_rows(logprobs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor | None:
    """Mask (True = keep) per row, :func:`_nucleus` of each; None when no row has one."""
    partial = top_ps < 1.0
    if not bool(partial.any()):
        return None
    keep = torch.isfinite(logprobs)
    rows = partial.nonzero()[:, 0]
    ordered, order = torch.sort(logprobs[rows], dim=-1, descending=True, stable=True)
    mass = torch.cumsum(ordered.exp(), dim=-1)
    wanted = top_ps[rows].to(torch.float64)[:, None].contiguous()
    keep_count = torch.searchsorted(mass, wanted, right=False) + 1
    ranks = torch.arange(logprobs.shape[-1], device=logprobs.device)[None, :]
    top = ranks < keep_count
    keep[rows] &= torch.zeros_like(top).scatter_(-1, order, top)
    return keep
