"""Progress on long work, on stderr and only when stderr is a terminal: stdout stays the
command's result (a table, or JSON), and logs and pipes get no bar redrawn in place."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Advance = Callable[[], None]


def _no_progress() -> None:
    pass


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


@contextmanager
def progress(description: str, total: int | None = None) -> Iterator[Advance]:
    """A bar of ``total`` steps (None: a spinner with the time elapsed, for work whose steps
    cannot be seen), gone once the work ends. Yields the function that advances it a step."""
    if not stderr_is_terminal():
        yield _no_progress
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns: list[ProgressColumn] = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn()]
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)
