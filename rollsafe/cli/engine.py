"""``rollsafe engine serve`` and ``rollsafe engine make-model``: a generation engine over HTTP,
the reference one or vLLM, and the tiny models vLLM serves in tests and the demo."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from pydantic import ValidationError

from rollsafe.cli.exits import EXIT_CODES, fail
from rollsafe.cli.options import LogFormatOption, LogLevelOption, PortOption, start_logging
from rollsafe.cli.tokens import refused_token_option, required_token, token_file_option
from rollsafe.engine.vllm.models import Arch, ModelSpec
from rollsafe.errors import InvalidInput, RollsafeError
from rollsafe.http.bearer import ENGINE_TOKEN_ENV

if TYPE_CHECKING:
    from rollsafe.engine.http import ClosableEngine

# rollsafe.engine.vllm.engine.Dtype, spelled again: that module imports torch (a second at
# every start of the command). A unit test checks the two agree.
Dtype = Literal["float32", "bfloat16"]
Backend = Literal["reference", "vllm", "scripted"]
REFERENCE_MODELS = ("dense", "moe")


def register_engine_commands(app: typer.Typer) -> None:
    """Add ``engine serve`` and ``engine make-model`` to the ``rollsafe`` command."""
    engine_cli = typer.Typer(no_args_is_help=True, help="Serve a generation engine over HTTP.")
    app.add_typer(engine_cli, name="engine")
    engine_cli.command("serve", epilog=EXIT_CODES)(engine_serve)
    engine_cli.command("make-model", epilog=EXIT_CODES)(make_model_command)


def engine_serve(
    port: PortOption,
    token_file: Annotated[Path | None, token_file_option("--token-file", ENGINE_TOKEN_ENV)] = None,
    token: Annotated[str | None, refused_token_option("--token", ENGINE_TOKEN_ENV)] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    backend: Annotated[
        Backend,
        typer.Option(
            help="reference (rollsafe's torch engine), vllm, or scripted (says what --script "
            "says, token by token: a policy for tests and demos)"
        ),
    ] = "reference",
    model: Annotated[
        str,
        typer.Option(
            help="reference: dense, moe or a make-model directory (its vocabulary, context and "
            "seed); vllm: a Hugging Face model directory"
        ),
    ] = "dense",
    seed: Annotated[
        int,
        typer.Option(help="reference: weight seed (same seed, same weights; a directory's own)"),
    ] = 0,
    dtype: Annotated[Dtype, typer.Option(help="vllm: the weights' and activations' type")] = (
        "float32"
    ),
    max_model_len: Annotated[
        int | None, typer.Option(help="vllm: longest prompt + max_tokens (default: model's)")
    ] = None,
    script: Annotated[
        Path | None,
        typer.Option(dir_okay=False, help="scripted: the replies (JSON; rollsafe.engine.scripted)"),
    ] = None,
    log_level: LogLevelOption = None,
    log_format: LogFormatOption = None,
) -> None:
    """Serve an engine until SIGINT/SIGTERM. Prints one line, `rollsafe engine serving
    <dense|moe> on http://host:port`, once listening (vLLM: after loading the model). The
    bearer token clients must send: ROLLSAFE_ENGINE_TOKEN, or --token-file."""
    import asyncio

    from rollsafe.engine.http import serve

    try:
        secret = required_token(token_file, file_flag="--token-file", envvar=ENGINE_TOKEN_ENV)
        start_logging(log_level, log_format)
        engine = _engine(backend, model, seed, dtype, max_model_len, script)
    except RollsafeError as exc:
        fail(exc)
    asyncio.run(serve(engine, host, port, secret))


def make_model_command(
    directory: Annotated[Path, typer.Argument(help="where to write it (reused if made)")],
    arch: Annotated[Arch, typer.Option(help="dense (Qwen2) or moe (Qwen3-MoE)")] = "dense",
    seed: Annotated[int, typer.Option(help="same seed, same weights")] = 0,
    max_positions: Annotated[
        int, typer.Option(help="longest prompt + generation (chats listing tools are long)")
    ] = ModelSpec().max_positions,
) -> None:
    """Build a tiny random-weight Hugging Face model, with a tokenizer and chat template, for
    `engine serve` (nothing is downloaded). Prints the directory."""
    from rollsafe.engine.vllm.models import make_model

    try:
        spec = ModelSpec(arch=arch, seed=seed, max_positions=max_positions)
        typer.echo(make_model(directory, spec))
    except (RollsafeError, ValidationError) as exc:
        fail(exc)
    except OSError as exc:  # the directory cannot be written: name it, not the stack
        fail(f"cannot write the model under {directory}: {exc.strerror or exc}")


def _engine(
    backend: Backend,
    model: str,
    seed: int,
    dtype: Dtype,
    max_model_len: int | None,
    script: Path | None = None,
) -> ClosableEngine:
    """The engine the flags ask for; :class:`InvalidInput` naming a bad flag."""
    if (backend == "scripted") != (script is not None):
        raise InvalidInput("--script goes with --backend scripted, and it needs one")
    if backend == "scripted":
        assert script is not None
        return _scripted(Path(model), script)
    if backend == "reference":
        from rollsafe.engine.model import ModelConfig
        from rollsafe.engine.torch_engine import TorchEngine

        # --model may be a directory, so click cannot check it as a choice: checked here.
        if model in REFERENCE_MODELS:
            return TorchEngine(ModelConfig(kind=model), seed)
        if not Path(model).is_dir():
            raise InvalidInput(f"--model must be dense or moe, or a model directory, not {model!r}")
        return TorchEngine.for_model(model)
    from rollsafe.engine.vllm.engine import VllmEngine

    return VllmEngine(model, dtype=dtype, max_model_len=max_model_len)


def _scripted(model: Path, script: Path) -> ClosableEngine:
    from rollsafe.engine.scripted import ScriptedEngine, load_script
    from rollsafe.engine.text import ChatCodec

    codec = ChatCodec.load(model)
    return ScriptedEngine(
        load_script(script),
        encode=codec.encode,
        decode=codec.decode,
        end_token=codec.stop_token_ids[0],
        vocab_size=codec.vocab_size,
    )
