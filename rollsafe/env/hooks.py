"""What an environment implements to become a checkpoint participant, and what it is given.

The toolkit (:mod:`rollsafe.env.participant`, :mod:`rollsafe.env.router`, served by
:func:`rollsafe.env.serve.serve`) owns the protocol: phases, lease, idempotent replay, retire
marks, parking, records on disk, restored records and the staged prefixes of cut calls. An
environment supplies only its own episode logic and state, through :class:`EnvironmentHooks`,
and marks where its episodes stand through the :class:`EpisodeSession` it is handed for each
episode run:

.. code-block:: python

    async def run_episode(self, run, session):
        state = session.restored or new_state(run.task)   # a restored attempt continues
        await session.boundary(state["turn"])              # parks here while a checkpoint is open
        while not done(state):
            request = session.request(state["turn"], prompt(state), max_tokens=8)
            completion = await session.complete(self.engine, request)  # cut and resumed for you
            with session.tool():                           # a tool call: never parked inside
                move = move_of(completion.tokens)
                await session.effect(state["turn"], "submit", submit, args=move)  # once
                apply(state, move)                         # the episode's own state; turn + 1
            await session.boundary(state["turn"])
        return EpisodeResult(episode=run.episode, reward=..., turns=state["turn"], restored=False)

Turn boundaries: ``boundary(t)`` says "t turns are complete and nothing is in flight"; call
it when an episode starts (t = 0, or a restored record's turn) and after every turn. The
state ``export_episode`` returns must be the state at that boundary. A restored attempt whose
record was parked while its model call was generating re-issues that call first (no boundary
before it): ``complete`` resumes it from the cut's prefix when the checkpoint staged one.

Effects: whatever an episode changes outside the state ``export_episode`` returns (a ledger,
a database, a message) goes through ``session.effect`` (once per rollout, turn and name,
whatever attempt asks: :mod:`rollsafe.env.effects`) or is itself idempotent by that key.

What the toolkit sets for you: ``EpisodeResult.restored`` (whether this attempt continued a
record) and ``EpisodeResult.restored_at_turn`` (the first boundary a restored attempt
reached), whatever ``run_episode`` returns there. A task the environment cannot run is
refused by raising :class:`~rollsafe.errors.InvalidInput` (answered 422, nothing changes);
a dependency that is down (the engine) by raising a transient error such as
:class:`~rollsafe.errors.EngineUnavailable` (503: the caller retries the same attempt, and a
restored attempt keeps its record until a run of it succeeds); anything else is a 500.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Protocol

from rollsafe.engine.protocol import Completion, Engine, GenerateRequest, PrefixRecord
from rollsafe.env.effects import EffectKey
from rollsafe.env.protocol import EpisodeRef, EpisodeResult, ParticipantKind, RunEpisode

# An effect's apply: given its key (for the system it writes to), returns a JSON result.
Apply = Callable[[EffectKey], Awaitable[Any] | Any]
# A call's tokens as they come (EpisodeSession.complete's on_tokens): ids and their logprobs.
OnTokens = Callable[[Sequence[int], Sequence[float]], None]


class EpisodeSession(Protocol):
    """Handed to :meth:`EnvironmentHooks.run_episode`, one per episode run."""

    episode: EpisodeRef
    # The state exported for the attempt this one continues (None: a fresh episode). Handed
    # again to every run of this attempt until one succeeds.
    restored: dict[str, Any] | None
    # Staged prefixes of the calls the checkpoint cut, by call id (complete() uses them).
    prefixes: Mapping[str, PrefixRecord]

    async def boundary(self, turn: int) -> None:
        """A turn boundary (``turn`` turns completed): waits here while the instance is parked."""
        ...

    def generating(self, call_id: str) -> AbstractAsyncContextManager[None]:
        """Inside: the episode waits on policy call ``call_id``; a prepare parks it as it is
        and reports the call id (the checkpoint cuts the call). A response that arrives while
        the instance is parked is held at the exit until resume, so the episode's state stays
        the one prepare reported even when the call could not be cut. :meth:`complete` does
        this for you."""
        ...

    def tool(self) -> AbstractContextManager[None]:
        """Inside: a tool call is mutating state; a prepare waits for it to end (until the
        deadline), else reports the episode in ``restarts``."""
        ...

    def request(
        self,
        turn: int,
        prompt_tokens: Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        name: str = "",
    ) -> GenerateRequest:
        """The model call of ``turn`` (``name`` tells several calls of one turn apart): call
        id ``<episode key>/t<turn>[/<name>]``, sampling seed from the rollout id, the turn
        and ``name`` only, so every attempt of the rollout samples what the first would."""
        ...

    async def complete(
        self, engine: Engine, request: GenerateRequest, *, on_tokens: OnTokens | None = None
    ) -> Completion:
        """Make ``request`` on ``engine`` inside :meth:`generating`. If the checkpoint this
        attempt was restored from cut this same call (same prompt and sampling), it resumes
        from the staged prefix under the original call id instead: the prefix's tokens are
        kept, never generated again (:meth:`resumed_tokens` says how many). ``on_tokens``
        (to stream the call) is given the call's tokens as they come: a resumed call's prefix
        at once, then each token as the engine makes it; a call a checkpoint cut and released
        goes on where it stopped, so the tokens given are the completion's, each once."""
        ...

    def resumed_tokens(self, completion: Completion) -> int:
        """How many of ``completion``'s tokens came from a staged prefix (0: none)."""
        ...

    async def effect(self, turn: int, name: str, apply: Apply, *, args: Any = None) -> Any:
        """Apply an effect outside the episode's state once per key ``(rollout, turn, name)``
        (never the attempt): ``apply(key)`` (sync or async) runs only if no attempt of this
        rollout applied the key before, on this instance or in the records it restored;
        otherwise its recorded result is returned. ``args`` (JSON) are what the effect does:
        asked again with other args, :class:`~rollsafe.errors.EffectDiverged`. A superseded
        attempt (a newer one of the rollout was run or restored here) is refused at once
        (409 ``superseded``). ``apply``'s result must be JSON (None is fine)."""
        ...


class EnvironmentHooks(ABC):
    """An environment's side of the toolkit. One instance per server process."""

    name: str = "environment"  # the participant name: a directory under the commit's dest
    kind: ParticipantKind = "environment"
    # Whether another instance of this environment can continue an exported episode: True
    # when export_episode's record is the whole state (the contract). False when a record
    # refers to what only its instance holds (a sandbox on its node): if that instance is
    # lost, its episodes restart from scratch instead of being restored on a survivor.
    portable: bool = True
    # What env-check needs told to verify this environment (docs/environment-protocol.md,
    # "env-check"). side_effects False: an episode changes nothing outside its own state (no
    # row written, no message sent), so no effect through session.effect is to be expected.
    side_effects: bool = True
    # Paths in a result's info that describe the attempt, not the episode (a step's attempt
    # number, a timing): left out when env-check compares attempts, as info["attempt"] always
    # is. Dotted keys; "[]" after a key: every item of its list; "*": every key of a dict.
    # E.g. ("steps[].attempt", "timings.*").
    attempt_info: tuple[str, ...] = ()

    @abstractmethod
    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        """Drive one episode to its end (see the module docstring)."""

    @abstractmethod
    def export_episode(self, episode: EpisodeRef) -> dict[str, Any]:
        """A JSON-able record of a parked episode's state at its boundary: enough to continue
        it elsewhere. Called only for episodes parked at a boundary or generating."""

    def restore_episode(self, episode: EpisodeRef, record: dict[str, Any]) -> None:
        """Check ``record`` (exported for ``episode``) before it is restored as
        ``episode.next_attempt()``: raise to refuse a bad record, and the whole restore is
        refused. The toolkit keeps the record and hands it to that attempt's runs
        (``session.restored``); by default every record is accepted."""
        return None  # not abstract on purpose: most environments need no check here

    def state_digest(self, episode: EpisodeRef) -> str | None:
        """A digest of everything this instance holds of ``episode`` at its current boundary,
        hidden state included (a library's internal game state, a random generator), and
        nothing that names the attempt. Optional: env-check compares a restored attempt's
        digests with the uninterrupted attempt's at every boundary, and says so when an
        environment implements none (None, the default)."""
        return None

    @abstractmethod
    def drop_episode(self, episode: EpisodeRef) -> None:
        """Forget whatever this instance holds of ``episode`` (a retired or abandoned attempt,
        restored state a failed restore leaves behind). Idempotent."""


# The earlier toolkit's restore_episode(episode, record, prefixes): the hook installed the
# record and took the staged prefixes of its cut calls itself. Called that way for one release
# more, with a DeprecationWarning; since then the session hands both to the restored attempt
# (session.restored, and session.complete resumes the cut call).
LEGACY_RESTORE = (
    "{cls}.restore_episode(episode, record, prefixes) is the earlier toolkit's signature: it is "
    "called that way in this release only (prefixes: the episode's staged prefixes, JSON by "
    "call id). Write restore_episode(episode, record): the session hands the record and the "
    "prefixes to the restored attempt (session.restored; session.complete resumes a cut call)"
)


def legacy_restore(env: EnvironmentHooks) -> bool:
    """Whether ``env`` implements the earlier three-argument ``restore_episode``."""
    try:
        parameters = inspect.signature(env.restore_episode).parameters
    except (TypeError, ValueError):  # a callable whose signature cannot be read: as today's
        return False
    positional = [
        p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(positional) == 3
