"""rollsafe's sampling inside vLLM: a logits processor that makes every draw a pure function of
``(seed, position)``, so a call resumed at token ``n`` on a fresh engine draws what the
uninterrupted call drew.

vLLM's own sampler cannot do this: ``SamplingParams.seed`` seeds one generator per request
that advances a step at a time, and nothing can advance a fresh one to token ``n``
(``docs/platform.md``). So each rollsafe call reaches vLLM as a *greedy* request with
this processor attached (``extra_args["rollsafe"]``). The processor samples the row itself
with :func:`rollsafe.engine.sampling.sample_rows` (temperature, top-p, the allowed set: the
reference engine's definition, bit for bit) and leaves one finite logit, the sampled token's
logprob, so vLLM's greedy pick is that token and, with ``logprobs_mode="processed_logits"``,
the logprob vLLM reports is the one the protocol defines (under ``softmax(logits / T)``).
Nothing travels outside vLLM's own outputs, so this works in-process and across processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm import SamplingParams as VllmSamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from rollsafe.engine.sampling import sample_rows

if TYPE_CHECKING:
    from vllm.config import VllmConfig

KEY = "rollsafe"  # the extra_args entry that carries a call's sampling


@dataclass(frozen=True)
class RowSampling:
    """One call's sampling as the processor sees it. ``offset``: the generated tokens the call
    had before this vLLM request (a resumed or released call's prefix), so the position of the
    next draw is ``offset + len(output)``."""

    seed: int
    temperature: float
    top_p: float
    offset: int
    allowed: tuple[int, ...] | None
    output: list[int]  # vLLM's live list of this request's generated tokens

    @property
    def position(self) -> int:
        return self.offset + len(self.output)


def extra_args(
    seed: int, temperature: float, top_p: float, offset: int, allowed: tuple[int, ...] | None
) -> dict[str, Any]:
    """What a rollsafe call puts in ``SamplingParams.extra_args``."""
    fields = {"seed": seed, "temperature": temperature, "top_p": top_p, "offset": offset}
    return {KEY: {**fields, "allowed": None if allowed is None else list(allowed)}}


def _row(
    params: VllmSamplingParams, _prompt: list[int] | None, output: list[int]
) -> RowSampling | None:
    fields = (params.extra_args or {}).get(KEY)
    if fields is None:
        return None
    allowed = fields["allowed"]
    return RowSampling(
        seed=fields["seed"],
        temperature=fields["temperature"],
        top_p=fields["top_p"],
        offset=fields["offset"],
        allowed=None if allowed is None else tuple(allowed),
        output=output,
    )


class RollsafeSampler(LogitsProcessor):  # type: ignore[misc]  # vLLM, read as Any (pyproject)
    """Samples every rollsafe row; other rows are left alone."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.device = device
        self.rows: dict[int, RowSampling] = {}

    @classmethod
    def validate_params(cls, sampling_params: VllmSamplingParams) -> None:
        fields = (sampling_params.extra_args or {}).get(KEY)
        if fields is not None and sampling_params.temperature != 0.0:
            raise ValueError("a rollsafe call reaches vLLM greedy: the processor samples it")

    def is_argmax_invariant(self) -> bool:
        return False  # it chooses the token

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, _row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        index = sorted(self.rows)
        rows = [self.rows[i] for i in index]
        every = len(index) == logits.shape[0]  # all rows ours (the usual case): no gather
        at = slice(None) if every else torch.tensor(index, device=logits.device)
        tokens, logprobs = sample_rows(
            logits[at],
            seeds=_column([r.seed for r in rows], torch.int64, logits.device),
            positions=_column([r.position for r in rows], torch.int64, logits.device),
            temperatures=_column([r.temperature for r in rows], torch.float64, logits.device),
            top_ps=_column([r.top_p for r in rows], torch.float64, logits.device),
            allowed=_allowed(rows, logits.shape[-1], logits.device),
        )
        logits[at] = float("-inf")
        picked = torch.arange(logits.shape[0], device=logits.device) if every else at
        logits[picked, tokens] = logprobs.to(logits.dtype)
        return logits


def _column(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _allowed(rows: list[RowSampling], vocab: int, device: torch.device) -> torch.Tensor | None:
    if all(r.allowed is None for r in rows):
        return None
    mask = torch.ones((len(rows), vocab), dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        if row.allowed is not None:
            mask[i] = False
            mask[i, list(row.allowed)] = True
    return mask
