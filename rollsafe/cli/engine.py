"""``rollsafe engine serve`` and ``rollsafe engine make-model``: a generation engine over HTTP,
the reference one or vLLM, and the tiny models vLLM serves in tests and the demo."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, cast

import typer

from rollsafe.errors import InvalidInput, RollsafeError

if TYPE_CHECKING:
    from rollsafe.engine.http import ClosableEngine


def register_engine_commands(app: typer.Typer, fail: Callable[[Exception, int], NoReturn]) -> None:
    """Add ``engine serve`` and ``engine make-model`` to the ``rollsafe`` command."""
    engine_cli = typer.Typer(no_args_is_help=True, help="Serve a generation engine over HTTP.")
    app.add_typer(engine_cli, name="engine")

    @engine_cli.command("serve")
    def engine_serve(
        port: Annotated[
            int, typer.Option(help="TCP port (0: any free one; the line printed names it)")
        ],
        token: Annotated[
            str,
            typer.Option(envvar="ROLLSAFE_ENGINE_TOKEN", help="bearer token clients must send"),
        ],
        host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
        backend: Annotated[
            str, typer.Option(help="reference (rollsafe's torch engine) or vllm")
        ] = "reference",
        model: Annotated[
            str,
            typer.Option(help="reference: dense or moe; vllm: a Hugging Face model directory"),
        ] = "dense",
        seed: Annotated[
            int, typer.Option(help="reference: weight seed (same seed, same weights)")
        ] = 0,
        dtype: Annotated[str, typer.Option(help="vllm: float32 or bfloat16")] = "float32",
        max_model_len: Annotated[
            int | None, typer.Option(help="vllm: longest prompt + max_tokens (default: model's)")
        ] = None,
    ) -> None:
        """Serve an engine until SIGINT/SIGTERM. Prints one line, `rollsafe engine serving
        <dense|moe> on http://host:port`, once listening (vLLM: after loading the model)."""
        import asyncio

        from rollsafe.engine.http import serve

        if not token.strip():
            fail(InvalidInput("--token (or ROLLSAFE_ENGINE_TOKEN) must not be empty"), 2)
        try:
            engine = _engine(backend, model, seed, dtype, max_model_len)
        except RollsafeError as exc:
            fail(exc, 2)
        asyncio.run(serve(engine, host, port, token))

    @engine_cli.command("make-model")
    def make_model_command(
        directory: Annotated[Path, typer.Argument(help="where to write it (reused if made)")],
        arch: Annotated[str, typer.Option(help="dense (Qwen2) or moe (Qwen3-MoE)")] = "dense",
        seed: Annotated[int, typer.Option(help="same seed, same weights")] = 0,
    ) -> None:
        """Build a tiny random-weight Hugging Face model for `engine serve --backend vllm`
        (nothing is downloaded). Prints the directory."""
        from rollsafe.engine.vllm.models import ModelSpec, make_model

        if arch not in ("dense", "moe"):
            fail(InvalidInput(f"--arch must be dense or moe, not {arch!r}"), 2)
        try:
            typer.echo(
                make_model(directory, ModelSpec.model_validate({"arch": arch, "seed": seed}))
            )
        except RollsafeError as exc:
            fail(exc, 2)


def _engine(
    backend: str, model: str, seed: int, dtype: str, max_model_len: int | None
) -> ClosableEngine:
    """The engine the flags ask for; :class:`InvalidInput` naming a bad flag."""
    if backend == "reference":
        from rollsafe.engine.model import ModelConfig
        from rollsafe.engine.torch_engine import TorchEngine

        if model not in ("dense", "moe"):
            raise InvalidInput(f"--model must be dense or moe, not {model!r}")
        return TorchEngine(ModelConfig(kind=model), seed)
    if backend == "vllm":
        if dtype not in ("float32", "bfloat16"):
            raise InvalidInput(f"--dtype must be float32 or bfloat16, not {dtype!r}")
        from rollsafe.engine.vllm.engine import Dtype, VllmEngine

        return VllmEngine(model, dtype=cast(Dtype, dtype), max_model_len=max_model_len)
    raise InvalidInput(f"--backend must be reference or vllm, not {backend!r}")
