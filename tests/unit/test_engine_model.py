"""The reference model: seeded weights, incremental steps that agree with the full forward,
and MoE routes that can be replayed in training."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rollsafe.engine.model import ModelConfig, TinyTransformer

TOKENS = [3, 17, 200, 5, 9, 44, 1, 250]


def stepped(model: TinyTransformer, tokens: list[int]) -> tuple[torch.Tensor, list[object]]:
    cache = model.new_cache(64)
    outputs = [model.step(t, cache) for t in tokens]
    return torch.stack([logits for logits, _ in outputs]), [route for _, route in outputs]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_same_seed_same_weights_other_seed_other_weights(kind: str) -> None:
    config = ModelConfig(kind=kind)
    a, b, c = TinyTransformer(config, 1), TinyTransformer(config, 1), TinyTransformer(config, 2)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    assert any(
        not torch.equal(x, z)
        for x, z in zip(a.state_dict().values(), c.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_steps_agree_with_the_full_forward(kind: str) -> None:
    model = TinyTransformer(ModelConfig(kind=kind), 3)
    logits, routes = stepped(model, TOKENS)
    with torch.no_grad():
        full, full_routes = model(torch.tensor([TOKENS]))
    torch.testing.assert_close(logits, full[0], rtol=1e-4, atol=1e-4)
    if kind == "moe":
        assert full_routes is not None and full_routes.shape == (1, len(TOKENS), 2, 2)
        assert routes == [tuple(map(tuple, token)) for token in full_routes[0].tolist()]
    else:
        assert full_routes is None and routes == [None] * len(TOKENS)


def test_replayed_routes_are_used_instead_of_fresh_ones() -> None:
    model = TinyTransformer(ModelConfig(kind="moe"), 4)
    tokens = torch.tensor([TOKENS])
    with torch.no_grad():
        fresh, chosen = model(tokens)
        assert chosen is not None
        same, _ = model(tokens, routes=chosen)
        flipped, used = model(tokens, routes=(chosen + 1) % 4)
    torch.testing.assert_close(same, fresh)
    assert used is not None and not torch.equal(used, chosen)
    assert not torch.allclose(flipped, fresh)


def test_a_full_cache_is_refused() -> None:
    model = TinyTransformer(ModelConfig(), 0)
    cache = model.new_cache(2)
    model.step(1, cache)
    model.step(2, cache)
    with pytest.raises(ValueError, match="capacity 2"):
        model.step(3, cache)


def test_config_refuses_impossible_shapes() -> None:
    with pytest.raises(ValidationError, match="multiple of n_heads"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValidationError, match="top_k=5 exceeds n_experts=4"):
        ModelConfig(kind="moe", top_k=5)
    assert ModelConfig(kind="moe").fingerprint() != ModelConfig().fingerprint()
