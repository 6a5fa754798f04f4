"""The ``drain`` phase's bookkeeping (docs/design.md section 5): replies still on the wire.

:class:`PendingReplies` is the dispatcher's record of ``/episodes/run`` calls sent and not yet
answered, keyed by episode key (:attr:`EpisodeRef.key`) with the instance each went to. A drain
waits only for the pending replies *outside* the commit scope: the scope's episodes are parked
and exported as they are, so their replies need no waiting.

Why a record of its own rather than a look through the live rollouts: the park window is the
cost users feel, and phases 2-9 must not do work that grows with the number of live rollouts
when it could grow with the number pending. Every operation here touches the pending set only:
``add``/``done``/``is_pending`` are O(1), ``outside`` is O(pending), and a waiter is woken by
``done`` itself (no polling). Admission is closed before a drain, so the pending set only
shrinks while one waits; an episode added meanwhile outside the scope is waited for too.

Pure: no I/O beyond :class:`asyncio.Event`; one event loop, no threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Set
from contextlib import suppress

from rollsafe.env.protocol import EpisodeRef


class _Waiter:
    """One ``wait_outside`` call: the keys it still waits for, and what wakes it."""

    __slots__ = ("event", "remaining", "scope")

    def __init__(self, scope: Set[str], remaining: set[str]) -> None:
        self.scope, self.remaining = scope, remaining
        self.event = asyncio.Event()


class PendingReplies:
    """``/episodes/run`` calls on the wire, by episode key (see the module docstring)."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[EpisodeRef, str]] = {}  # key -> (episode, instance)
        self._waiters: list[_Waiter] = []

    def add(self, ref: EpisodeRef, instance: str) -> None:
        """A call for ``ref`` was sent to ``instance`` (replaces an entry of the same key)."""
        key = ref.key
        self._pending[key] = (ref, instance)
        for waiter in self._waiters:
            if key not in waiter.scope:
                waiter.remaining.add(key)

    def done(self, ref: EpisodeRef) -> None:
        """The call for ``ref`` got its reply (or failed). Idempotent: an unknown key is a no-op."""
        key = ref.key
        if self._pending.pop(key, None) is None:
            return
        for waiter in self._waiters:
            if key in waiter.remaining:
                waiter.remaining.discard(key)
                if not waiter.remaining:
                    waiter.event.set()

    def is_pending(self, key: str) -> bool:
        """O(1)."""
        return key in self._pending

    def instance_of(self, key: str) -> str | None:
        """The instance the pending call for ``key`` went to; None when not pending."""
        entry = self._pending.get(key)
        return None if entry is None else entry[1]

    def __len__(self) -> int:
        return len(self._pending)

    def outside(self, scope_keys: Set[str]) -> list[EpisodeRef]:
        """Pending episodes NOT in ``scope_keys`` (a set: O(1) membership), in the order they
        were added. O(pending): the live rollouts are never looked at."""
        return [ref for key, (ref, _) in self._pending.items() if key not in scope_keys]

    async def wait_outside(self, scope_keys: Set[str], deadline_s: float) -> list[EpisodeRef]:
        """Wait until no pending reply outside ``scope_keys`` remains, or ``deadline_s`` seconds
        have passed. Returns the episodes still pending outside the scope (sorted by key): the
        stragglers, which become restarts. Woken by :meth:`done`; never polls."""
        remaining = {key for key in self._pending if key not in scope_keys}
        if remaining and deadline_s > 0:
            waiter = _Waiter(scope_keys, remaining)
            self._waiters.append(waiter)
            try:
                with suppress(TimeoutError):
                    async with asyncio.timeout(deadline_s):
                        await waiter.event.wait()
            finally:
                self._waiters.remove(waiter)
        # done() discards from ``remaining``: what is left is still pending.
        return [self._pending[key][0] for key in sorted(remaining)]
