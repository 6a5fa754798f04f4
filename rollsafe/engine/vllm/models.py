"""Tiny Hugging Face models, built here with random weights and a tokenizer trained here:
nothing can be downloaded on the machines rollsafe is tested on.

``rollsafe engine make-model DIR --arch dense|moe`` (or :func:`make_model`) writes a
``save_pretrained`` directory that vLLM (and transformers) load like any other: a Qwen2
(dense) or a Qwen3-MoE (8 experts, top-2) with 2 layers, hidden size 128, head size 32 (vLLM's
CPU attention refuses some head sizes, e.g. 24) and a vocabulary of 1,024. Beside the weights, a
byte-level BPE tokenizer of the same vocabulary with a ChatML/Hermes chat template
(:mod:`rollsafe.engine.text`): engines speak token ids, and the tokenizer turns chats, tools
and tool calls into them and back. The same arguments always make the same weights and the same
tokenizer files, and an existing directory made with them is reused: a ``rollsafe-model.json``
beside the weights records the arguments (a directory made before models carried a tokenizer
gets one when reused).

Weights are drawn with a wider spread than transformers' default (``initializer_range``
0.02), whose logits are nearly flat: tokens then depend on the model, not only on the noise.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollsafe.engine.text import MIN_VOCAB_SIZE, VOCAB_SIZE, has_tokenizer, write_tokenizer
from rollsafe.errors import InvalidInput

Arch = Literal["dense", "moe"]
MARKER = "rollsafe-model.json"


class ModelSpec(BaseModel):
    """What :func:`make_model` builds; each default defined here once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arch: Arch = "dense"
    seed: int = Field(default=0, ge=0)
    # The tokenizer's too: at least its bytes and added tokens.
    vocab_size: int = Field(default=VOCAB_SIZE, ge=MIN_VOCAB_SIZE)
    hidden_size: int = Field(default=128, ge=8)
    layers: int = Field(default=2, ge=1)
    heads: int = Field(default=4, ge=1)
    kv_heads: int = Field(default=2, ge=1)
    max_positions: int = Field(default=1024, ge=8)
    experts: int = Field(default=8, ge=2)
    experts_per_token: int = Field(default=2, ge=1)
    initializer_range: float = Field(default=0.2, gt=0)


def make_model(directory: str | Path, spec: ModelSpec | None = None) -> Path:
    """Build (or reuse) the model ``spec`` describes in ``directory``; returns the directory."""
    spec = spec or ModelSpec()
    root = Path(directory)
    marker = root / MARKER
    if marker.is_file():
        if ModelSpec.model_validate_json(marker.read_text()) != spec:
            raise InvalidInput(f"{root} holds another model ({marker}); choose an empty directory")
        if not has_tokenizer(root):  # made before models carried one
            write_tokenizer(root, spec.vocab_size)
        return root
    if root.exists() and any(root.iterdir()):
        raise InvalidInput(f"{root} is not empty and not a rollsafe-made model")
    # Built beside it and renamed: a half-written directory is never taken for a model.
    partial = root.with_name(f".{root.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_tokenizer(partial, spec.vocab_size)  # first: it refuses a vocabulary it cannot fill
    _build(spec).save_pretrained(partial)
    (partial / MARKER).write_text(json.dumps(spec.model_dump(), indent=2) + "\n")
    if root.exists():
        root.rmdir()
    partial.rename(root)
    return root


def read_spec(directory: str | Path) -> ModelSpec:
    """The spec :func:`make_model` recorded in ``directory``."""
    marker = Path(directory) / MARKER
    if not marker.is_file():
        raise InvalidInput(
            f"{directory} is not a model directory rollsafe made (no {MARKER}): "
            "make one with `rollsafe engine make-model`"
        )
    return ModelSpec.model_validate_json(marker.read_text())


def _build(spec: ModelSpec) -> Any:  # a transformers model
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": 2 * spec.hidden_size,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.hidden_size // spec.heads,
        "max_position_embeddings": spec.max_positions,
        "initializer_range": spec.initializer_range,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(spec.seed)
    if spec.arch == "dense":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    moe = Qwen3MoeConfig(
        **common,
        num_experts=spec.experts,
        num_experts_per_tok=spec.experts_per_token,
        moe_intermediate_size=spec.hidden_size // 2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return Qwen3MoeForCausalLM(moe)
