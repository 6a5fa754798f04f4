"""Calls raced against each other, for tests of "exactly one wins" (conditional creates,
concurrent publishers)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def all_at_once(calls: Sequence[Callable[[], T]], timeout_s: float = 60.0) -> list[T | Exception]:
    """Run each call in a thread of its own, all released at the same instant by a barrier;
    what each returned, or the exception it raised, in the order of ``calls``."""
    barrier = threading.Barrier(len(calls))
    outcomes: dict[int, T | Exception] = {}

    def run(n: int) -> None:
        barrier.wait()
        try:
            outcomes[n] = calls[n]()
        except Exception as exc:  # the caller decides which failures are the expected ones
            outcomes[n] = exc

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"a raced call did not return within {timeout_s:g} s")
    return [outcomes[n] for n in range(len(calls))]
