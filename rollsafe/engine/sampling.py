"""Stateless sampling: the noise for generated position ``p`` is a pure function of (seed, p).

Engines usually seed one random generator per request at admission and draw from it token by
token; a call resumed at token ``n`` on a fresh engine then draws the wrong numbers. Here every
draw is computed from a counter: ``u[v] = hash(seed, p, v)`` for each vocabulary entry ``v``
(splitmix64 finalizers, 53-bit uniforms), and the token is chosen by Gumbel-max over the
nucleus. Nothing is carried from one position to the next, so any position can be the first.

Pure numpy, no I/O: the same logits, seed and position give the same token and logprob bit for
bit on any machine with IEEE doubles.
"""

from __future__ import annotations

import numpy as np

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
