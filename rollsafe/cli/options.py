"""Options and arguments several commands take, spelled once so that they read alike."""

from __future__ import annotations

from typing import Annotated

import typer

RunArgument = Annotated[str, typer.Argument(help="run id")]
JsonOption = Annotated[
    bool, typer.Option("--json", help="one JSON document on stdout (and nothing else there)")
]
PortOption = Annotated[
    int,
    typer.Option(min=0, max=65535, help="TCP port (0: any free one; the line printed names it)"),
]
