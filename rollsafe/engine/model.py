"""A small decoder-only transformer on CPU: the reference engine's policy.

Two variants from one class: dense (an MLP per block) and mixture-of-experts (a router picks
``top_k`` of ``n_experts`` expert MLPs per token per block). Weights come from a seed, so two
processes built with the same config and seed hold the same model bit for bit.

Two ways to run it:

- :meth:`TinyTransformer.step` feeds one token of one call at one position against the call's
  own :class:`KVCache`. The engine uses only this, for prompts as well as generated tokens, so
  the arithmetic behind position ``p`` is the same whether the call ran straight through or was
  cut and re-fed its prompt and prefix on a fresh engine (batch invariance: nothing depends on
  which other calls were in flight or on how the prompt was chunked).
- :meth:`TinyTransformer.forward` runs whole sequences with a causal mask, for training; it can
  replay recorded MoE routes instead of routing afresh.
"""

from __future__ import annotations

import hashlib
import math
from typing import Literal, cast

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from rollsafe.engine.protocol import Route


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["dense", "moe"] = "dense"
    vocab_size: int = Field(default=512, ge=2)
    d_model: int = Field(default=64, ge=8)
    n_layers: int = Field(default=2, ge=1)
    n_heads: int = Field(default=4, ge=1)
    d_ff: int = Field(default=128, ge=8)
    max_positions: int = Field(default=1024, ge=2)
    n_experts: int = Field(default=4, ge=2, description="MoE only")
    top_k: int = Field(default=2, ge=1, description="MoE only")

    @model_validator(mode="after")
    def _shapes(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
        return self

    def fingerprint(self) -> str:
        """sha256 of the architecture: prefixes resume only on a model with the same one."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


class KVCache:
    """One call's keys and values, preallocated for its whole budget."""

    def __init__(self, config: ModelConfig, capacity: int) -> None:
        shape = (config.n_layers, capacity, config.d_model)
        self.keys = torch.zeros(shape)
        self.values = torch.zeros(shape)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]


class _Experts(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, d, f = config.n_experts, config.d_model, config.d_ff
        self.top_k = config.top_k
        self.router = nn.Linear(d, e, bias=False)
        self.w_in = nn.Parameter(torch.empty(e, d, f))
        self.w_out = nn.Parameter(torch.empty(e, f, d))

    def choose(self, x: torch.Tensor) -> torch.Tensor:
        """Expert ids ``[tokens, top_k]``, best first."""
        return torch.topk(self.router(x), self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        """``x``: ``[tokens, d]``; ``routes``: ``[tokens, top_k]`` expert ids."""
        gates = torch.softmax(torch.gather(self.router(x), -1, routes), dim=-1)
        out = torch.zeros_like(x)
        for slot in range(self.top_k):
            w_in = self.w_in[routes[:, slot]]  # [tokens, d, f]
            w_out = self.w_out[routes[:, slot]]  # [tokens, f, d]
            hidden = F.gelu(torch.bmm(x.unsqueeze(1), w_in))
            out = out + gates[:, slot : slot + 1] * torch.bmm(hidden, w_out).squeeze(1)
        return out


class _Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.norm_attn = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm_ffn = nn.LayerNorm(d)
        self.experts: _Experts | None = None
        if config.kind == "moe":
            self.experts = _Experts(config)
        else:
            self.mlp = nn.Sequential(
                nn.Linear(d, config.d_ff), nn.GELU(), nn.Linear(config.d_ff, d)
            )

    def _ffn(
        self, x: torch.Tensor, routes: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.experts is None:
            return self.mlp(x), None
        chosen = self.experts.choose(x) if routes is None else routes
        return self.experts(x, chosen), chosen

    def step(
        self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token ``x`` (``[1, d]``) at ``position``; writes its key and value into the cache."""
        q, k, v = self.qkv(self.norm_attn(x)).chunk(3, dim=-1)
        keys[position] = k[0]
        values[position] = v[0]
        h, n = self.n_heads, position + 1
        dh = x.shape[-1] // h
        q = q.view(h, 1, dh)
        k_all = keys[:n].view(n, h, dh).transpose(0, 1)
        v_all = values[:n].view(n, h, dh).transpose(0, 1)
        weights = torch.softmax(q @ k_all.transpose(1, 2) / math.sqrt(dh), dim=-1)
        x = x + self.out((weights @ v_all).reshape(1, -1))
        ffn, route = self._ffn(self.norm_ffn(x), None)
        return x + ffn, route

    def forward(
        self, x: torch.Tensor, routes: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x``: ``[batch, time, d]``, causal; ``routes``: ``[batch, time, top_k]`` to replay."""
        b, t, d = x.shape
        h, dh = self.n_heads, d // self.n_heads
        q, k, v = self.qkv(self.norm_attn(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, h, dh).transpose(1, 2) for z in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, d))
        flat_routes = None if routes is None else routes.reshape(b * t, -1)
        ffn, chosen = self._ffn(self.norm_ffn(x).reshape(b * t, d), flat_routes)
        return x + ffn.view(b, t, d), None if chosen is None else chosen.view(b, t, -1)


class TinyTransformer(nn.Module):
    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.embed = nn.Embedding(config.vocab_size, d)
        self.positions = nn.Embedding(config.max_positions, d)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, config.vocab_size, bias=False)
        self.reset(seed)

    @torch.no_grad()
    def reset(self, seed: int) -> None:
        """Weights drawn from ``seed`` alone, in a fixed order: same seed, same model."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in sorted(self.named_parameters()):
            if name.endswith("bias"):
                param.zero_()
            elif "norm" in name:
                param.fill_(1.0)
            else:
                # The head is drawn wider so a random policy is peaked enough for top-p to matter.
                std = 1.0 / math.sqrt(self.config.d_model) if name == "head.weight" else 0.05
                param.copy_(torch.randn(param.shape, generator=generator) * std)

    @property
    def is_moe(self) -> bool:
        return self.config.kind == "moe"

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.config, min(capacity, self.config.max_positions))

    @torch.inference_mode()
    def step(self, token: int, cache: KVCache) -> tuple[torch.Tensor, Route | None]:
        """Feed ``token`` at the cache's next position; the next-token logits (float32,
        ``[vocab]``) and, for MoE, the experts each layer chose (``[layer][k]``)."""
        position = cache.length
        if position >= cache.capacity:
            raise ValueError(f"position {position} is past the cache's capacity {cache.capacity}")
        x = (self.embed.weight[token] + self.positions.weight[position]).unsqueeze(0)
        routes: list[tuple[int, ...]] = []
        for layer, block in enumerate(self.blocks):
            x, route = cast(_Block, block).step(x, cache.keys[layer], cache.values[layer], position)
            if route is not None:
                routes.append(tuple(route[0].tolist()))
        cache.length = position + 1
        logits: torch.Tensor = self.head(self.norm(x))[0]
        return logits, tuple(routes) if self.is_moe else None

    def forward(
        self, tokens: torch.Tensor, routes: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[batch, time, vocab]`` for ``tokens`` ``[batch, time]``, and the routes used
        (``[batch, time, layer, k]``, MoE). ``routes`` given: replayed instead of chosen."""
        _, t = tokens.shape
        x = self.embed(tokens) + self.positions(torch.arange(t))
        used = []
        for layer, block in enumerate(self.blocks):
            x, chosen = block(x, None if routes is None else routes[:, :, layer])
            used.append(chosen)
        logits = self.head(self.norm(x))
        if not self.is_moe:
            return logits, None
        return logits, torch.stack([u for u in used if u is not None], dim=2)
