"""What an environment implements to become a checkpoint participant, and what it is given.

The toolkit (:mod:`rollsafe.env.participant`, :mod:`rollsafe.env.router`) owns the protocol:
phases, lease, idempotent replay, retire marks, parking, records on disk. An environment
supplies only its own episode logic and state, through :class:`EnvironmentHooks`, and marks
where its episodes stand through the :class:`EpisodeSession` it is handed for each episode:

.. code-block:: python

    async def run_episode(self, run, session):
        state = session.restored or new_state(run.task)
        while not done(state):
            await session.boundary(state.turn)        # parks here while a checkpoint is open
            async with session.generating(call_id):   # a model call: may be cut while parked
                action = await policy(...)
            with session.tool():                      # a tool call: never parked inside
                apply(action)
        return EpisodeResult(...)

``export_episode`` and ``restore_episode`` are called only for episodes parked at a boundary or
generating (never inside a tool call), so the state they see is a turn boundary's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Protocol

from rollsafe.env.protocol import EpisodeRef, EpisodeResult, ParticipantKind, RunEpisode


class EpisodeSession(Protocol):
    """Handed to :meth:`EnvironmentHooks.run_episode`, one per episode run."""

    episode: EpisodeRef
    # The record ``restore_episode`` installed for this attempt, if it continues one.
    restored: dict[str, Any] | None

    async def boundary(self, turn: int) -> None:
        """A turn boundary (``turn`` turns completed): waits here while the instance is parked."""
        ...

    def generating(self, call_id: str) -> AbstractAsyncContextManager[None]:
        """Inside: the episode waits on policy call ``call_id``; a prepare parks it as it is
        and reports the call id (the checkpoint cuts the call). A response that arrives while
        the instance is parked is held at the exit until resume, so the episode's state stays
        the one prepare reported even when the call could not be cut."""
        ...

    def tool(self) -> AbstractContextManager[None]:
        """Inside: a tool call is mutating state; a prepare waits for it to end (until the
        deadline), else reports the episode in ``restarts``."""
        ...


class EnvironmentHooks(ABC):
    """An environment's side of the toolkit. One instance per server process."""

    name: str = "environment"  # the participant name: a directory under the commit's dest
    kind: ParticipantKind = "environment"

    @abstractmethod
    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        """Drive one episode to its end (see the module docstring)."""

    @abstractmethod
    def export_episode(self, episode: EpisodeRef) -> dict[str, Any]:
        """A JSON-able record of a parked episode's state: enough to continue it elsewhere."""

    @abstractmethod
    def restore_episode(
        self, episode: EpisodeRef, record: dict[str, Any], prefixes: dict[str, Any]
    ) -> None:
        """Install ``record`` (exported for ``episode``) to be continued as
        ``episode.next_attempt()``. ``prefixes`` maps a model call id to its staged prefix
        record (JSON) when the checkpoint cut that call. Raise to refuse (a bad record)."""

    @abstractmethod
    def drop_episode(self, episode: EpisodeRef) -> None:
        """Forget whatever this instance holds of ``episode`` (a retired or abandoned attempt,
        restored state a failed restore leaves behind). Idempotent."""
