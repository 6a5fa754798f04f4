"""What the vLLM engine asks of vLLM's worker (``worker_extension_cls``, reached through
``collective_rpc``): MoE routes and weight updates.

**Routes.** vLLM's MoE routers accept a capture function that receives every forward's expert
ids (``[tokens, k]``, before any expert-parallel remapping). This extension sets one per MoE
layer and wraps the model runner's forward: after each forward it keeps, for every request in
the batch, the experts of the request's *last* row, the position whose logits the next token
is sampled from, keyed by that position. A generated token ``i`` of a call with a prompt of
``P`` tokens was sampled from position ``P + i - 1``, however the call was admitted (fresh,
released or resumed with a prefix), so routes are keyed by call, not by vLLM request. That
last row is never served from the prefix cache (vLLM always computes it to get logits), so
the prefix cache never hides a route the protocol needs. (``enable_return_routed_experts``
needs Model Runner V2, which does not run on CPU, and reports routes only once a request
finishes: a cut needs them mid-call.)

**Weights.** ``reload_weights`` takes checkpoint names (what ``save_pretrained`` wrote), so a
trainer pushes the state dict it has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from rollsafe.engine.protocol import Route


class RollsafeWorker:
    """Mixed into vLLM's worker class; methods are called by name with ``collective_rpc``."""

    model_runner: Any  # vLLM's, set by the worker this is mixed into

    def rollsafe_capture_routes(self) -> int:
        """Install the capture on every MoE layer; how many layers route (0: a dense model)."""
        runner = self.model_runner
        routers = [
            module.router
            for _, module in runner.get_model().named_modules()
            if callable(getattr(getattr(module, "router", None), "set_capture_fn", None))
        ]
        self._rollsafe_forward: dict[int, torch.Tensor] = {}
        self._rollsafe_routes: dict[str, dict[int, Route]] = {}
        for layer, router in enumerate(routers):
            router.set_capture_fn(self._rollsafe_capture(layer))
        if routers:
            runner._model_forward = self._rollsafe_wrap(runner._model_forward, len(routers))
        return len(routers)

    def rollsafe_take_routes(self) -> dict[str, dict[int, Route]]:
        """Routes captured since the last take: ``{vllm request id: {position: route}}``."""
        taken, self._rollsafe_routes = self._rollsafe_routes, {}
        return taken

    def rollsafe_load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        # In place, through vLLM's reloader: on CPU the linear layers hand their weights to
        # oneDNN at load and keep none, so a plain load_weights has nothing to load into.
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()))

    def _rollsafe_capture(self, layer: int) -> Callable[[torch.Tensor], None]:
        def capture(expert_ids: torch.Tensor) -> None:
            self._rollsafe_forward[layer] = expert_ids.detach().to("cpu", copy=True)

        return capture

    def _rollsafe_wrap(self, forward: Callable[..., Any], layers: int) -> Callable[..., Any]:
        runner = self.model_runner

        def captured(*args: Any, **kwargs: Any) -> Any:
            self._rollsafe_forward.clear()
            output = forward(*args, **kwargs)
            if len(self._rollsafe_forward) == layers:
                positions = kwargs["positions"].to("cpu")
                self._rollsafe_keep(runner, positions, layers)
            return output

        return captured

    def _rollsafe_keep(self, runner: Any, positions: torch.Tensor, layers: int) -> None:
        n = runner.input_batch.num_reqs
        starts = runner.query_start_loc.cpu[: n + 1].tolist()
        per_layer = [self._rollsafe_forward[layer].tolist() for layer in range(layers)]
        for i, request_id in enumerate(runner.input_batch.req_ids[:n]):
            last = starts[i + 1] - 1
            route = tuple(tuple(per_layer[layer][last]) for layer in range(layers))
            self._rollsafe_routes.setdefault(request_id, {})[int(positions[last])] = route
