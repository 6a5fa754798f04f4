"""The gateway as a checkpoint participant: its episodes are agent runs, its state each
session's record (docs/gateway.md, "Durable sessions").

An episode is one run of the agent's entry point (:mod:`rollsafe.gateway.agents`) with the
task; its model and tool calls come back to the gateway in the episode's session. Export is the
session's record; a restored attempt runs the agent again from its start and the session
replays the record (:mod:`rollsafe.gateway.record`). If the agent asks for something else than
it did (:class:`~rollsafe.errors.ReplayDiverged`), the episode falls back: the record is
dropped and the agent runs once more from its start in a new session, sampling anew (the
rollout is generated again, as the sibling restore level does). Either way the episode's
result carries every call's tokens (``info["calls"]``): the training row.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from rollsafe.env.hooks import EnvironmentHooks, EpisodeSession
from rollsafe.env.protocol import EpisodeRef, EpisodeResult, RunEpisode
from rollsafe.errors import InvalidInput, ParticipantRefused, ReplayDiverged
from rollsafe.gateway.agents import AgentEntry, AgentOutcome
from rollsafe.gateway.record import Replay, SessionRecord
from rollsafe.gateway.sessions import LiveSession, Served, Upstream

log = logging.getLogger(__name__)
FALLBACK_SEED = "fallback"


class GatewayHooks(EnvironmentHooks):
    name = "gateway"
    kind = "agent"

    def __init__(
        self,
        served: Served,
        agent: AgentEntry | None,
        tools: Mapping[str, Upstream] | None = None,
        *,
        name: str = "gateway",
    ) -> None:
        self.name = name
        self.served, self.agent = served, agent
        self.tools = dict(tools or {})
        self.url = ""  # where the gateway listens (set by serve once bound): agents' base URLs
        self.sessions: dict[str, LiveSession] = {}  # by session id: the runs in progress
        self._by_episode: dict[str, LiveSession] = {}  # by episode key: what export dumps

    # -- sessions ----------------------------------------------------------------------------

    def session(self, session: str) -> LiveSession:
        """The live session ``session``; refused (409 ``session_ended``) when no episode run
        here has it: over, superseded by a later attempt, or never started."""
        live = self.sessions.get(session)
        if live is None or live.ended:
            raise ParticipantRefused(
                "session_ended",
                f"session {session} is not running here (its episode ended, a later attempt "
                "superseded it, or it never started)",
            )
        return live

    def session_of_episode(self, rollout_id: str, attempt: int) -> str | None:
        """The live session of the attempt ``(rollout_id, attempt)``, if one runs here: how a
        NeMo Gym environment server's resources seed, which names only its episode, finds it."""
        for session, live in self.sessions.items():
            ref = live.episode.episode
            if (ref.rollout_id, ref.attempt) == (rollout_id, attempt) and not live.ended:
                return session
        return None

    # -- hooks -------------------------------------------------------------------------------

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        if self.agent is None:
            raise InvalidInput("this gateway runs no agent (start it with --agent-url or --agent)")
        key = session.episode.key
        record = (
            None if session.restored is None else SessionRecord.model_validate(session.restored)
        )
        try:
            live, outcome = await self._attempt(run.task, session, key, record, seed_name="")
            fell_back = None
            if live.diverged is not None:
                fell_back = str(live.diverged)
                log.warning("episode %s falls back to a fresh run: %s", key, fell_back)
                live, outcome = await self._attempt(
                    run.task, session, f"{key}.fresh", None, seed_name=FALLBACK_SEED
                )
        finally:  # the run is over, finished or failed: nothing exports it any more
            self._by_episode.pop(key, None)
        assert outcome is not None  # a run without a record cannot diverge
        return self._result(session.episode, live, outcome, fell_back)

    async def _attempt(
        self,
        task: Mapping[str, Any],
        episode: EpisodeSession,
        session: str,
        record: SessionRecord | None,
        *,
        seed_name: str,
    ) -> tuple[LiveSession, AgentOutcome | None]:
        """One run of the agent in ``session``; (its session, its outcome or None if it
        diverged from ``record``)."""
        assert self.agent is not None
        replay = Replay(session, episode.episode.rollout_id, record, self.served.codec.decode)
        live = LiveSession(session, episode, replay, self.served, seed_name)
        self.sessions[session] = live
        self._by_episode[episode.episode.key] = live
        try:
            outcome = await self.agent.run(task, session, episode.episode)
        except Exception:
            if live.diverged is not None:  # the agent failed because its call was refused
                return live, None
            raise
        finally:
            live.end()
            self.sessions.pop(session, None)
            for server in self.tools.values():
                server.forget(session)
        if live.diverged is not None:  # the agent took the refusal and went on
            return live, None
        if live.replay.replaying:
            raise ReplayDiverged(
                session,
                f"model call {live.replay.calls_made}",
                f"the agent finished after {live.replay.calls_made} of the "
                f"{len(live.replay.record.calls)} recorded calls",
            )
        return live, outcome

    def _result(
        self, episode: EpisodeRef, live: LiveSession, outcome: AgentOutcome, fell_back: str | None
    ) -> EpisodeResult:
        record = live.replay.record
        calls = [
            {
                "index": c.index,
                "prompt_token_ids": list(c.prompt_tokens),
                "generation_token_ids": list(c.tokens),
                "generation_log_probs": list(c.logprobs),
                "weight_versions": list(c.weight_versions),
                "resumed_tokens": c.resumed_tokens,
                **({} if c.routes is None else {"routed_experts": c.routes}),
            }
            for c in record.calls
        ]
        info: dict[str, Any] = {
            "session": live.session,
            "calls": calls,
            "tool_calls": [
                {"server": t.server, "path": t.path, "status": t.status, "reply": t.reply}
                for t in record.tools
            ],
            "replayed_calls": live.replay.replayed_calls,
            "agent": outcome.info,
        }
        if fell_back is not None:
            info["fell_back"] = fell_back
        return EpisodeResult(
            episode=episode, reward=outcome.reward, turns=len(calls), restored=False, info=info
        )

    def export_episode(self, episode: EpisodeRef) -> dict[str, Any]:
        live = self._by_episode.get(episode.key)
        if live is None:
            raise InvalidInput(f"gateway holds no session of episode {episode.key}")
        return live.replay.record.model_dump(mode="json")

    def restore_episode(self, episode: EpisodeRef, record: dict[str, Any]) -> None:
        parsed = SessionRecord.model_validate(record)
        if parsed.rollout_id != episode.rollout_id:
            raise InvalidInput(f"record is for {parsed.rollout_id}, not {episode.rollout_id}")

    async def aclose(self) -> None:
        """Close the agent's and the tool servers' connections."""
        if self.agent is not None:
            await self.agent.aclose()
        for server in self.tools.values():
            await server.aclose()

    def drop_episode(self, episode: EpisodeRef) -> None:
        live = self._by_episode.pop(episode.key, None)
        if live is not None:
            live.end()
            self.sessions.pop(live.session, None)
