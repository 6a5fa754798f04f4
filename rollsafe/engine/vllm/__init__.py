"""The engine protocol on vLLM: :class:`rollsafe.engine.vllm.engine.VllmEngine` (``rollsafe
engine serve --backend vllm``). Nothing here imports vLLM until an engine is built, so the rest
of rollsafe runs without it; docs/generation-cuts.md, "vLLM", has the design."""
