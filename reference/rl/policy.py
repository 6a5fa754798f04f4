"""The model the reference trainer trains: the reference engine's own
(:class:`~rollsafe.engine.model.ModelConfig`, rebuilt from a seed) or a Hugging Face model
directory (:class:`HfModel`), the one ``rollsafe engine serve --backend vllm`` serves.

Either way the trainer sees one forward, ``logits, routes = forward(inputs, routes)``, and a
state dict named as the engine names its weights, so ``update_weights`` needs no mapping.

A Hugging Face model is trained dense only: replaying recorded MoE routes needs a hook into
each transformers MoE block's router, which the reference run does not build (the vLLM engine
records routes all the same; ``rollsafe demo --engine vllm`` runs a dense model).
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from rollsafe.engine.model import ModelConfig, TinyTransformer
from rollsafe.engine.vllm.engine import model_fingerprint
from rollsafe.errors import InvalidInput


class HfModel(BaseModel):
    """A Hugging Face model directory, trained in float32 (the dtype the engine serves it in
    for exact resume: ``engine serve --backend vllm --dtype float32``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["hf"] = "hf"
    path: Path

    @cached_property
    def config(self) -> dict[str, Any]:
        """The directory's config.json."""
        file = self.path / "config.json"
        if not file.is_file():
            raise InvalidInput(f"{self.path} is not a model directory (no config.json)")
        config: dict[str, Any] = json.loads(file.read_text())
        return config

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def max_positions(self) -> int:
        return int(self.config["max_position_embeddings"])

    def fingerprint(self) -> str:
        """The vLLM engine's fingerprint of this directory in float32."""
        return model_fingerprint(self.path, "float32")


PolicyModel = ModelConfig | HfModel


def build(model: PolicyModel, seed: int) -> nn.Module:
    """The trainable module: a :class:`TinyTransformer` from ``seed``, or the directory's
    weights (``seed`` plays no part: the directory holds them)."""
    if isinstance(model, ModelConfig):
        return TinyTransformer(model, seed)
    from transformers import AutoModelForCausalLM

    # num_experts, num_local_experts, n_routed_experts: each family names it its own way.
    if any("experts" in key for key in model.config):
        raise InvalidInput(
            f"{model.path} is a mixture-of-experts model: the reference trainer trains a "
            "Hugging Face model dense only (no route replay)"
        )
    module: nn.Module = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32)
    return module


def forward(
    model: PolicyModel, module: nn.Module, inputs: torch.Tensor, routes: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logits, routes chosen)``; ``routes`` given replays them (reference MoE only)."""
    if isinstance(model, ModelConfig):
        logits, chosen = module(inputs, routes)
        return logits, chosen
    return module(inputs).logits, None
