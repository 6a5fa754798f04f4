"""Stateless sampling: the draw at (seed, position) is a pure function, and it samples the
distribution it claims to."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from rollsafe.engine.protocol import SamplingParams
from rollsafe.engine.sampling import sample, uniforms

LOGITS = np.random.default_rng(0).standard_normal(64).astype(np.float32) * 2


def test_uniforms_are_a_pure_function_of_seed_and_position() -> None:
    a = uniforms(7, 3, 1000)
    assert np.array_equal(a, uniforms(7, 3, 1000))
    assert ((a > 0) & (a < 1)).all()
    assert not np.array_equal(a, uniforms(7, 4, 1000))
    assert not np.array_equal(a, uniforms(8, 3, 1000))
    # A prefix of the vocabulary draws the same numbers: the noise of entry v is f(seed, p, v).
    assert np.array_equal(uniforms(7, 3, 10), a[:10])
    assert abs(a.mean() - 0.5) < 0.03


def test_largest_seed_and_position_do_not_overflow() -> None:
    u = uniforms(2**63 - 1, 2**40, 16)
    assert ((u > 0) & (u < 1)).all()


def test_sample_at_a_position_does_not_depend_on_what_was_drawn_before() -> None:
    params = SamplingParams(seed=5, temperature=1.0)
    straight = [sample(LOGITS, params, p) for p in range(20)]
    resumed = [sample(LOGITS, params, p) for p in range(12, 20)]
    assert straight[12:] == resumed


def test_draws_follow_the_softmax_of_the_scaled_logits() -> None:
    logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    params = SamplingParams(seed=1, temperature=0.8)
    n = 20_000
    counts = np.bincount([sample(logits, params, p)[0] for p in range(n)], minlength=4)
    expected = np.exp(logits / 0.8) / np.exp(logits / 0.8).sum()
    # Four standard errors: a biased sampler (e.g. ignoring temperature) lands far outside.
    assert np.all(np.abs(counts / n - expected) < 4 * np.sqrt(expected * (1 - expected) / n))


def test_logprob_is_that_of_the_sampling_distribution() -> None:
    params = SamplingParams(seed=3, temperature=0.5)
    token, logprob = sample(LOGITS, params, 0)
    scaled = LOGITS.astype(np.float64) / 0.5
    expected = scaled[token] - math.log(np.exp(scaled - scaled.max()).sum()) - scaled.max()
    assert logprob == pytest.approx(expected, rel=1e-6)
    assert logprob == float(np.float32(logprob))  # reported as float32, exactly


def test_greedy_and_a_tiny_nucleus_take_the_best_token() -> None:
    best = int(np.argmax(LOGITS))
    assert sample(LOGITS, SamplingParams(seed=1, temperature=0.0), 9)[0] == best
    assert all(sample(LOGITS, SamplingParams(seed=1, top_p=1e-6), p)[0] == best for p in range(50))


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    params = SamplingParams(seed=2, top_p=0.8)  # the nucleus is {0, 1}: 0.5 + 0.3 reaches 0.8
    drawn = {sample(logits, params, p)[0] for p in range(2000)}
    assert drawn == {0, 1}


def test_allowed_tokens_constrain_the_draw() -> None:
    params = SamplingParams(seed=4, allowed_token_ids=(3, 17))
    assert {sample(LOGITS, params, p)[0] for p in range(200)} == {3, 17}


def test_sampling_params_refuse_nonsense_by_name() -> None:
    with pytest.raises(ValidationError, match="top_p"):
        SamplingParams(seed=1, top_p=0.0)
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(seed=1, temperature=-1)
    with pytest.raises(ValidationError, match="extra"):
        SamplingParams.model_validate({"seed": 1, "beam_width": 4})


def test_sample_rows_is_sample_on_every_row_bit_for_bit() -> None:
    """The batched torch version (vLLM's sampler) against the definition: 200 random batches
    of every temperature, nucleus, allowed set, seed (up to 2**63 - 1) and vocabulary size."""
    import torch

    from rollsafe.engine.sampling import sample_rows, uniforms_rows, uniforms_rows_torch

    rng = np.random.default_rng(0)
    for _ in range(200):
        vocab, rows = int(rng.integers(2, 3000)), int(rng.integers(1, 9))
        scale = rng.choice([0.01, 1.0, 5.0])
        logits = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
        allowed = rng.random((rows, vocab)) < 0.5 if rng.random() < 0.3 else None
        if allowed is not None and not allowed.any(axis=1).all():
            continue  # a row with nothing allowed cannot be sampled (nor asked for)
        params = [
            SamplingParams(
                seed=int(rng.integers(0, 2**63)),
                temperature=float(rng.choice([0.0, 0.5, 1.0, 1.7])),
                top_p=float(rng.choice([1.0, 0.9, 0.3, 0.01])),
                allowed_token_ids=None
                if allowed is None
                else tuple(np.flatnonzero(allowed[i]).tolist()),
            )
            for i in range(rows)
        ]
        positions = rng.integers(0, 10_000, rows)
        seeds = torch.tensor([p.seed for p in params])
        want_u = np.stack(
            [uniforms(p.seed, int(q), vocab) for p, q in zip(params, positions, strict=True)]
        )
        for rows_of in (uniforms_rows, uniforms_rows_torch):  # the CPU's and a GPU's
            assert np.array_equal(rows_of(seeds, torch.tensor(positions), vocab).numpy(), want_u)
        tokens, logprobs = sample_rows(
            torch.from_numpy(logits),
            seeds=seeds,
            positions=torch.tensor(positions),
            temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float64),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float64),
            allowed=None if allowed is None else torch.from_numpy(allowed),
        )
        want = [sample(logits[i], params[i], int(positions[i])) for i in range(rows)]
        assert list(zip(tokens.tolist(), logprobs.tolist(), strict=True)) == want
