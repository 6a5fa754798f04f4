"""An asyncio event loop on a thread of its own, for synchronous code that drives asynchronous
clients.

The controller's checkpoint phases are synchronous (Ray runs actor calls on threads), while the
environment and engine clients are asyncio (httpx), and an httpx client must stay on the loop
it was created on. So the controller's participants live on one long-lived loop, and each phase
hands it a coroutine and waits; the synchronous SDK (rollsafe.client's SyncCheckpointer) drives
its asynchronous twin the same way. Neutral ground: no rollsafe import.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "rollsafe-loop") -> None:
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(started.set)
            self.loop.run_forever()

        self._thread = threading.Thread(target=serve, name=name, daemon=True)
        self._thread.start()
        started.wait()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coroutine`` on the loop and wait for its result (its exception is raised
        here). Never call it from the loop's own thread: that would wait forever."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("LoopThread.run called from its own loop: await instead")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coroutine`` on the loop without waiting for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        """Stop the loop after the work already handed to it; idempotent."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
