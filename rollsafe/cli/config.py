"""``rollsafe config show``: the effective settings (:class:`rollsafe.Settings`) and where each
value came from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rollsafe.cli.exits import EXIT_CODES, fail
from rollsafe.cli.options import JsonOption
from rollsafe.errors import RollsafeError
from rollsafe.settings import CONFIG_ENV


def register_config_commands(app: typer.Typer) -> None:
    config_cli = typer.Typer(
        no_args_is_help=True, help="The effective settings and where each came from."
    )
    app.add_typer(config_cli, name="config")

    @config_cli.command("show", epilog=EXIT_CODES)
    def config_show(
        file: Annotated[
            Path | None,
            typer.Option(
                "--file",
                help=f"a YAML settings file (its `rollsafe:` section if it has one); default: "
                f"the file {CONFIG_ENV} names",
            ),
        ] = None,
        as_json: JsonOption = False,
    ) -> None:
        """Every setting rollsafe reads (environment variables ROLLSAFE_*, TEMPORAL_*,
        RAY_ADDRESS, and the settings file), its value, and where it came from: default,
        env NAME, file PATH, or profile 'P' in FILE (Temporal's TOML config: the profile
        TEMPORAL_PROFILE names, in TEMPORAL_CONFIG_FILE). Secrets are masked. Exit 2 when a
        setting is unknown or malformed, naming it."""
        from rich.console import Console
        from rich.table import Table

        from rollsafe.settings import Settings

        try:
            rows = Settings.load(file=file).effective()
        except RollsafeError as exc:
            fail(exc)
        if as_json:
            typer.echo(json.dumps([row.model_dump(mode="json") for row in rows], indent=2))
            return
        table = Table("setting", "value", "source")
        for row in rows:
            table.add_row(row.key, json.dumps(row.value), row.source)
        Console(width=160).print(table)
