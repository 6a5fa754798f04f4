"""Options and arguments several commands take, spelled once so that they read alike."""

from __future__ import annotations

from typing import Annotated

import typer

from rollsafe.settings import LogFormat, LogLevel

RunArgument = Annotated[str, typer.Argument(help="run id")]
JsonOption = Annotated[
    bool, typer.Option("--json", help="one JSON document on stdout (and nothing else there)")
]
AcceptJournalLossOption = Annotated[
    bool,
    typer.Option(
        "--accept-journal-loss",
        help="restore although the journal does not continue the snapshot (a gap, a missing "
        "segment or folder, another journal's segments): what does not continue it is set "
        "aside, and the plan names what was lost (docs/journal.md)",
    ),
]
PortOption = Annotated[
    int,
    typer.Option(min=0, max=65535, help="TCP port (0: any free one; the line printed names it)"),
]

# Every long-running command takes these; without them, the settings' telemetry section
# (ROLLSAFE_TELEMETRY__LOG_LEVEL, ..._LOG_FORMAT) decides, and its defaults are INFO and text.
LogLevelOption = Annotated[
    LogLevel | None,
    typer.Option(
        "--log-level",
        case_sensitive=False,
        help="lines at this level and above, on stderr (default: telemetry.log_level)",
    ),
]
LogFormatOption = Annotated[
    LogFormat | None,
    typer.Option(
        "--log-format", help="text, or one JSON object per line (default: telemetry.log_format)"
    ),
]


def start_logging(level: str | None, fmt: str | None) -> None:
    """Configure the process's logs from the flags, else the settings (docs/operations.md,
    "Telemetry"). Bad settings raise :class:`~rollsafe.errors.InvalidInput`."""
    from rollsafe.observability.logs import configure_logging
    from rollsafe.settings import Settings

    telemetry = Settings.load().telemetry
    configure_logging(level or telemetry.log_level, fmt or telemetry.log_format)
