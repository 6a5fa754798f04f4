"""One episode run's :class:`~rollsafe.env.hooks.EpisodeSession`: where the episode stands
(at a boundary, generating, in a tool call) as its :class:`~rollsafe.env.participant.Participant`
sees it, and the places it waits while the instance is parked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, Literal

from rollsafe.env.protocol import EpisodeRef, EpisodeResult

if TYPE_CHECKING:
    from rollsafe.env.participant import Participant

# "running": between markers, i.e. neither capturable nor known to be mutating.
Activity = Literal["running", "boundary", "generating", "tool"]


class Session:
    """The :class:`~rollsafe.env.hooks.EpisodeSession` of one episode run."""

    def __init__(self, owner: Participant, episode: EpisodeRef, restored: dict[str, Any] | None):
        self.episode, self.restored, self._owner = episode, restored, owner
        self.activity: Activity = "running"
        self.call_id: str | None = None
        # moved: left the activity prepare reported it parked in, while the checkpoint is open;
        # its state is no longer the one reported, so commit must not export it.
        self.turn, self.moved, self.retired = 0, False, False
        self.task: asyncio.Task[EpisodeResult] | None = None

    async def boundary(self, turn: int) -> None:
        self.turn = turn
        release = self._owner._release
        if release is None:
            return
        self.activity = "boundary"
        self._owner._changed.set()
        await release.wait()  # Participant._close has already set activity back to running

    @asynccontextmanager
    async def generating(self, call_id: str) -> AsyncIterator[None]:
        """While parked, a model response is held here until resume: the episode then still
        stands where prepare reported it (in flight), whether or not the cut froze the call."""
        self._mark("generating", call_id)
        try:
            yield
        except BaseException:
            self._unmark()
            raise
        release = self._owner._release
        if release is not None:
            await release.wait()
        self._unmark()

    @contextmanager
    def tool(self) -> Iterator[None]:
        self._mark("tool", None)
        try:
            yield
        finally:
            self._unmark()

    def _mark(self, activity: Activity, call_id: str | None) -> None:
        self.activity, self.call_id = activity, call_id
        self._owner._changed.set()

    def _unmark(self) -> None:
        self.activity, self.call_id = "running", None
        if self._owner._release is not None:
            self.moved = True
        self._owner._changed.set()
