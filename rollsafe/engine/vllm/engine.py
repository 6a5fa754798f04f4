"""The engine protocol on vLLM: :class:`VllmEngine` serves any Hugging Face model directory
vLLM loads, with exact cuts, exact resume under sampling, and MoE routes.

Why a stepped ``LLMEngine`` and not ``AsyncLLM``: a cut must see every call at a token
boundary and know exactly which tokens it made. Driving ``step()`` from one thread (the
:class:`~rollsafe.engine.loop.EngineLoop`, as the reference engine does) gives that by
construction: commands run between two steps, when every token vLLM made has been delivered and
nothing is half-way. With ``AsyncLLM`` an abort races the output stream.

- **Sampling.** Each call reaches vLLM greedy, with :class:`~rollsafe.engine.vllm.sampler.
  RollsafeSampler` choosing the token by ``(seed, position)``; see that module.
- **Cut** aborts the call's vLLM request between two steps and keeps its tokens, logprobs,
  weight versions and routes here: the call is *frozen*. **Release** admits it again as a new
  vLLM request whose prompt is the prompt plus the tokens made (the prefix cache makes that
  cheap), continuing at the same position: the tokens are those it would have made anyway.
  **Resume** does the same from a :class:`~rollsafe.engine.protocol.PrefixRecord`, on any
  engine of the same model.
- **Weights.** An update preempts every running call (vLLM recomputes their context with the
  new weights) and empties the prefix cache, so a call's tokens after an update are the same
  whether it stayed in flight or was cut and resumed after the update.
- **Refused at admission** (422): a token id outside the vocabulary (vLLM itself would crash
  on one), a prompt plus ``max_tokens`` longer than the model allows. vLLM's penalties, stop
  strings, grammars and seed cannot be asked for: :class:`~rollsafe.engine.protocol.
  SamplingParams` has no such field, and an unknown field is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from rollsafe.engine.loop import CallState, EngineLoop, Sink
from rollsafe.engine.protocol import GenerateRequest, PrefixRecord, Route
from rollsafe.errors import EngineUnavailable, InvalidInput

Dtype = Literal["float32", "bfloat16"]
# vLLM's defaults for a machine like this one (docs/platform.md): in-process engine (a
# third of the start-up time, identical outputs) and 1 GiB of CPU KV cache (without it vLLM
# reserves 10 GiB and starts three times slower). An environment that sets them wins.
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_ATTN_SPLIT_KV": "0",
}
# Config keys that say nothing about the architecture.
_NOT_ARCHITECTURE = {"transformers_version", "_name_or_path", "dtype", "torch_dtype"}
# vLLM's in-process engine keeps its parallel state in module globals: two engines in one
# process break each other (measured: closing one kills the other's next step). One at a time.
_ONE_PER_PROCESS = threading.Lock()


@dataclass(kw_only=True)
class VllmCall(CallState):
    vllm_id: str | None = None  # the vLLM request making its tokens now; None while frozen
    internal_id: str | None = None  # vLLM's own id for that request (its routes are keyed so)
    pending_routes: dict[int, Route] = field(default_factory=dict)  # captured, by position


def model_fingerprint(model_dir: Path, dtype: str) -> str:
    """The architecture (config.json without version noise) and the dtype: records resume
    only on an engine that computes the same way. Weights are not part of it."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = {k: v for k, v in sorted(config.items()) if k not in _NOT_ARCHITECTURE}
    canonical = json.dumps({"engine": "vllm", "dtype": dtype, "config": arch}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


class VllmEngine(EngineLoop[VllmCall]):
    """vLLM behind the engine protocol. Construction loads the model (seconds); ``async with``
    or :meth:`close` ends it. One per process (vLLM's in-process state is global): serve more
    with ``rollsafe engine serve --backend vllm``, one process each."""

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: Dtype = "float32",
        weight_version: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        engine_args: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__("rollsafe-vllm")
        self.model_dir = Path(model)
        config_file = self.model_dir / "config.json"
        if not config_file.is_file():
            raise InvalidInput(f"{self.model_dir} is not a model directory (no config.json)")
        self.fingerprint = model_fingerprint(self.model_dir, dtype)
        self.vocab_size = int(json.loads(config_file.read_text())["vocab_size"])
        self.weight_shapes = _checkpoint_shapes(self.model_dir)
        self.weight_version = weight_version
        self.kind = "dense"  # until the model is loaded and its routers counted
        self._args = {
            "model": str(self.model_dir),
            "dtype": dtype,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            **(engine_args or {}),
        }
        self._llm: Any = None
        self._admitted = 0
        self._by_vllm: dict[str, VllmCall] = {}  # vLLM request id -> call
        self._internal: dict[str, str] = {}  # vLLM's internal request id -> ours
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        if not _ONE_PER_PROCESS.acquire(blocking=False):
            raise InvalidInput(
                "a vLLM engine already runs in this process: close it first, or serve each "
                "engine in its own process (rollsafe engine serve --backend vllm)"
            )
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise EngineUnavailable(f"vLLM did not start: {self._failure}") from self._failure

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights between two steps (names and shapes as in the model's checkpoint);
        tokens after it carry ``version``."""
        self._check_weights(weights)
        await super().update_weights(weights, version)

    async def __aenter__(self) -> VllmEngine:
        return self

    # -- the loop -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _owning(self) -> Iterator[None]:
        try:
            self._llm = self._build()
            self.context = int(self._llm.model_config.max_model_len)
            routed = self._llm.collective_rpc("rollsafe_capture_routes")[0]
            self.kind = "moe" if routed else "dense"
        except BaseException as exc:  # handed to the constructor's caller
            self._failure = exc
            self._closing = True
        self._ready.set()
        try:
            yield
        finally:
            try:
                if self._llm is not None:
                    self._llm.engine_core.shutdown()
                    _free_vllm_process_state()
            finally:
                _ONE_PER_PROCESS.release()

    def _build(self) -> Any:
        for name, value in VLLM_ENV.items():
            os.environ.setdefault(name, value)
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        from rollsafe.engine.vllm.sampler import RollsafeSampler

        args = EngineArgs(
            **self._args,
            skip_tokenizer_init=True,  # rollsafe speaks token ids
            enforce_eager=True,
            async_scheduling=False,  # a step's outputs are that step's tokens
            logits_processors=[RollsafeSampler],
            logprobs_mode="processed_logits",  # the sampler's logprob (see sampler.py)
            worker_extension_cls="rollsafe.engine.vllm.worker.RollsafeWorker",
        )
        with _modules_vllm_can_scan():
            return LLMEngine.from_engine_args(args)

    def _round(self) -> None:
        self._run_pending_commands()
        if not self._by_vllm:
            return
        outputs = self._llm.step()
        if self.kind == "moe":
            self._collect_routes()
        for output in outputs:
            call = self._by_vllm.get(output.request_id)
            if call is not None:
                self._deliver(call, output)

    def _collect_routes(self) -> None:
        for internal, routes in self._llm.collective_rpc("rollsafe_take_routes")[0].items():
            call = self._by_vllm.get(self._internal.get(internal, ""))
            if call is not None:
                call.pending_routes.update(routes)

    def _deliver(self, call: VllmCall, output: Any) -> None:
        """The tokens one step made for the call (with ``logprobs_mode="processed_logits"``,
        the sampler's logprob for each)."""
        completion = output.outputs[0]
        prompt = len(call.request.prompt_tokens)
        for token, logprobs in zip(completion.token_ids, completion.logprobs or (), strict=True):
            # Token i was sampled from the logits at position prompt + i - 1.
            position = prompt + len(call.tokens) - 1
            route = call.pending_routes.pop(position) if call.routes is not None else None
            if self._made(call, token, float(logprobs[token].logprob), route) or call.held:
                return
        if output.finished:  # vLLM ended it and the call's own rules did not: say so
            self._fail(call, f"vLLM ended call {call.call_id} ({completion.finish_reason})")

    # -- what the loop asks of an engine ------------------------------------------------------

    def _new_call(self, request: GenerateRequest, sink: Sink) -> VllmCall:
        return VllmCall(request=request, sink=sink, routes=[] if self.kind == "moe" else None)

    def _check_request(self, request: GenerateRequest, prefix: PrefixRecord | None) -> None:
        super()._check_request(request, prefix)
        call = request.call_id
        if self.kind == "moe" and prefix is not None and prefix.routes is None:
            raise InvalidInput(f"call {call}: the prefix has no routes; this model is MoE")

    def _start(self, call: VllmCall) -> None:
        """Hand the call to vLLM from its current token on: a new vLLM request whose prompt is
        the call's prompt and the tokens it made, sampling from the next position."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from rollsafe.engine.vllm.sampler import extra_args

        params = call.request.sampling
        made = len(call.tokens)
        if made and call.tokens[-1] in params.stop_token_ids:
            return self._finish(call, "stop")  # a prefix that ended the call
        if made >= params.max_tokens:
            return self._finish(call, "length")
        self._admitted += 1
        vllm_id = f"{call.call_id}#{self._admitted}"
        sampling = SamplingParams(
            temperature=0.0,  # greedy: the sampler has chosen the token (sampler.py)
            max_tokens=params.max_tokens - made,
            ignore_eos=True,  # only the call's stop tokens stop it
            detokenize=False,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra_args(
                params.seed, params.temperature, params.top_p, made, params.allowed_token_ids
            ),
        )
        prompt = TokensPrompt(prompt_token_ids=[*call.request.prompt_tokens, *call.tokens])
        call.internal_id = self._llm.add_request(vllm_id, prompt, sampling)
        self._internal[call.internal_id] = vllm_id
        self._by_vllm[vllm_id] = call
        call.vllm_id = vllm_id
        call.frozen = False
        return None

    def _freeze(self, call: VllmCall) -> None:
        self._stop_generating(call)
        call.frozen = True

    def _thaw(self, call: VllmCall) -> None:
        self._start(call)

    def _hold_call(self, call: VllmCall) -> None:
        # vLLM's scheduler steps every request it has: a held call leaves it, as a frozen one
        # does, and comes back as a new request from its tokens (the same tokens follow).
        self._stop_generating(call)
        call.held = True

    def _unhold(self, call: VllmCall) -> None:
        call.held = False
        if not call.frozen:
            self._start(call)

    def _drop(self, call: VllmCall) -> None:
        self._stop_generating(call)
        super()._drop(call)

    def _stop_generating(self, call: VllmCall) -> None:
        if call.vllm_id is not None:
            self._by_vllm.pop(call.vllm_id, None)
            self._internal.pop(call.internal_id or "", None)
            self._llm.abort_request([call.vllm_id])
            call.vllm_id = call.internal_id = None
        call.pending_routes.clear()

    def _check_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        unknown = sorted(set(weights) - set(self.weight_shapes))
        if unknown:
            raise InvalidInput(f"weights {unknown[:5]} are not in {self.model_dir}'s checkpoint")
        for name, tensor in weights.items():
            if tuple(tensor.shape) != self.weight_shapes[name]:
                raise InvalidInput(
                    f"weight {name}: shape {tuple(tensor.shape)}, the model's is "
                    f"{self.weight_shapes[name]}"
                )
            if not tensor.is_floating_point():
                raise InvalidInput(f"weight {name}: {tensor.dtype} is not a float dtype")

    def _load(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._llm.collective_rpc("rollsafe_load_weights", args=(dict(weights),))
        # Running calls go back to vLLM's queue and recompute their context with the new
        # weights; nothing cached from the old ones is served again.
        if not self._llm.reset_prefix_cache(reset_running_requests=True):
            raise EngineUnavailable("vLLM did not reset its prefix cache after a weight update")


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every weight name and shape in the model's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(checkpoint.get_slice(name).get_shape())
    if not shapes:
        raise InvalidInput(f"{model_dir} has no *.safetensors weights")
    return shapes


@contextlib.contextmanager
def _modules_vllm_can_scan() -> Iterator[None]:
    """At start-up vLLM's CPU platform scans every loaded module's globals with ``hasattr(v,
    "__dict__")`` (``triton_utils.dispatcher._rebind_kernels``); a value that raises there
    instead of answering (werkzeug's unbound ``flask.current_app``, loaded by moto, say) kills
    the start. Such modules are out of ``sys.modules`` while vLLM starts, and back after."""
    hidden = {name: m for name, m in list(sys.modules.items()) if not _scannable(m)}
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)


def _scannable(module: object) -> bool:
    try:
        for value in list(getattr(module, "__dict__", {}).values()):
            hasattr(value, "__dict__")
    except Exception:
        return False
    return True


def _free_vllm_process_state() -> None:
    """vLLM's in-process engine leaves its (single-rank) process group behind; free it so the
    next engine in this process can start."""
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    destroy_model_parallel()
    destroy_distributed_environment()
