"""The table of checks that ``rollsafe verify``, ``rollsafe demo`` and ``rollsafe doctor`` print:
one row per check, its verdict coloured (green ok, yellow skipped, red anything else)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

_STYLES = {"ok": "green", "skipped": "yellow"}
WIDTH = 140


def print_check_table(
    title: str,
    rows: Iterable[Sequence[str]],
    columns: Sequence[str] = ("check", "result", "detail"),
) -> None:
    """Print ``rows`` (name, verdict, then the other columns' text) under ``title``."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title))
    for column in columns:
        table.add_column(column)
    for name, verdict, *rest in rows:
        style = _STYLES.get(verdict, "red")
        # Details quote paths, commands and lists: escaped so "[...]" is never read as markup.
        cells = [escape(cell) for cell in rest]
        table.add_row(escape(name), f"[{style}]{escape(verdict)}[/{style}]", *cells)
    Console(width=WIDTH).print(table)
