"""A live session's model call on an MoE engine (pure: a stand-in engine and episode session):
its routes reach the record and the reply's routed_experts, one per token kept (a stop string
cuts them with the tokens); a listener is told the call's start and given its tokens as they
come; a replayed call from the record tells it nothing. A session's model and tool calls are
taken one at a time; an episode whose agent failed is no longer exported."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from types import MappingProxyType
from typing import Any, Literal

import pytest

from rollsafe.engine.protocol import FinishEvent, GenerateRequest, StreamEvent, TokenEvent
from rollsafe.engine.text import ChatCodec
from rollsafe.env.hooks import OnTokens
from rollsafe.env.protocol import EpisodeRef, RunEpisode
from rollsafe.env.session import complete_call, turn_request
from rollsafe.errors import InvalidInput
from rollsafe.gateway.agents import FunctionAgent
from rollsafe.gateway.convert import Prompt, chat_reply
from rollsafe.gateway.hooks import GatewayHooks
from rollsafe.gateway.record import Replay
from rollsafe.gateway.sessions import LiveSession, Served

EPISODE = EpisodeRef(rollout_id="moe-0_g0", attempt=0)
TEXT = "Route me. STOP and more"


class MoeEngine:
    """Answers every call with ``tokens``, each routed to experts (its index, its index + 1)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tuple(tokens)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        for i, token in enumerate(self.tokens):
            route = ((i, i + 1), (i + 1, i))  # two layers, top-2
            yield TokenEvent(
                call_id=request.call_id, index=i, token=token, logprob=-0.1, weight_version=0,
                route=route,
            )  # fmt: skip
        yield FinishEvent(call_id=request.call_id, reason="stop", n_tokens=len(self.tokens))


class Episode:
    """The toolkit's episode session as the gateway uses it, without a participant."""

    episode = EPISODE
    restored = None
    prefixes: Mapping[str, Any] = MappingProxyType({})

    async def boundary(self, turn: int) -> None:
        return None

    @asynccontextmanager
    async def generating(self, call_id: str) -> AsyncIterator[None]:
        yield

    @contextmanager
    def tool(self) -> Iterator[None]:
        yield

    def request(self, turn: int, prompt_tokens: Sequence[int], **sampling: Any) -> GenerateRequest:
        return turn_request(self.episode, turn, prompt_tokens, **sampling)

    async def complete(
        self, engine: Any, request: GenerateRequest, *, on_tokens: OnTokens | None = None
    ) -> Any:
        return await complete_call(engine, request, None, self.generating, on_tokens)

    def resumed_tokens(self, completion: Any) -> int:
        return 0


def _session(codec: ChatCodec, record: Any = None) -> LiveSession:
    served = Served(engine=MoeEngine(codec.encode(TEXT)), codec=codec, model="moe")  # type: ignore[arg-type]
    replay = Replay(EPISODE.key, EPISODE.rollout_id, record, codec.decode)
    return LiveSession(EPISODE.key, Episode(), replay, served, "")  # type: ignore[arg-type]


def _prompt() -> Prompt:
    messages = [{"role": "user", "content": "route"}]
    return Prompt(messages, None, max_tokens=32, temperature=1.0, top_p=1.0, stops=("STOP",))


async def test_routes_reach_the_record_and_the_reply_one_per_token_kept(codec: ChatCodec) -> None:
    session = _session(codec)
    started: list[tuple[str, int, int]] = []
    streamed: list[int] = []

    class Recorder:
        def started(self, rollout_id: str, index: int, created_at: int) -> None:
            started.append((rollout_id, index, created_at))

        def tokens(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
            streamed.extend(ids)

    answer = await session.model_call(_prompt(), Recorder())
    made = codec.encode(TEXT)
    assert streamed == list(made) and started[0][:2] == ("moe-0_g0", 0)
    [call] = session.replay.record.calls
    assert call.routes is not None and len(call.routes) == len(made)  # the record: all of them
    assert call.created_at == started[0][2]
    kept = len(answer.tokens)
    assert kept < len(made) and "STOP" not in (answer.content or "")  # the stop cut them
    message = chat_reply(answer, logprobs=False)["choices"][0]["message"]
    assert message["routed_experts"] == [[[i, i + 1], [i + 1, i]] for i in range(kept)]

    replayed = _session(codec, session.replay.record)
    quiet = Recorder()
    started.clear()
    streamed.clear()
    again = await replayed.model_call(_prompt(), quiet)
    assert (started, streamed) == ([], []) and again.routes == answer.routes


class HeldEngine(MoeEngine):
    """Holds each call before its first token until the test releases it."""

    def __init__(self, tokens: Sequence[int]) -> None:
        super().__init__(tokens)
        self.reached, self.release = asyncio.Event(), asyncio.Event()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        self.reached.set()
        await self.release.wait()
        async for event in super().generate(request):
            yield event


class ContendedLock(asyncio.Lock):
    """An asyncio.Lock that sets :attr:`contended` when a caller finds it held."""

    def __init__(self) -> None:
        super().__init__()
        self.contended = asyncio.Event()

    async def acquire(self) -> Literal[True]:
        if self.locked():
            self.contended.set()
        return await super().acquire()


class ToolServer:
    name = "tools"

    def __init__(self) -> None:
        self.calls = 0

    async def forward(
        self, session: str, method: str, path: str, body: bytes, content_type: str
    ) -> tuple[int, str, str]:
        self.calls += 1
        return 200, "application/json", "{}"

    def forget(self, session: str) -> None:
        return None

    async def aclose(self) -> None:
        return None


async def test_a_tool_call_waits_for_the_model_call_in_flight_in_its_session(
    codec: ChatCodec,
) -> None:
    engine, tools = HeldEngine(codec.encode(TEXT)), ToolServer()
    served = Served(engine=engine, codec=codec, model="moe")  # type: ignore[arg-type]
    replay = Replay(EPISODE.key, EPISODE.rollout_id, None, codec.decode)
    session = LiveSession(EPISODE.key, Episode(), replay, served, "")  # type: ignore[arg-type]
    session._lock = lock = ContendedLock()  # the session's one lock, telling when it is waited on
    model = asyncio.ensure_future(session.model_call(_prompt()))
    await engine.reached.wait()
    made_tool = session.tool_call(tools, "POST", "/step", b"{}", "application/json")
    tool = asyncio.ensure_future(made_tool)
    waiting = asyncio.ensure_future(lock.contended.wait())
    # Either the tool call waits for the model call's lock, or it ran beside it (and is done).
    await asyncio.wait({tool, waiting}, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    assert tools.calls == 0 and not tool.done(), "the tool call ran beside the model call"
    engine.release.set()
    await model
    made = await tool
    assert tools.calls == 1 and made.index == 0
    assert len(session.replay.record.calls) == 1


async def test_an_episode_whose_agent_failed_is_no_longer_exported(codec: ChatCodec) -> None:
    served = Served(engine=MoeEngine(codec.encode(TEXT)), codec=codec, model="moe")  # type: ignore[arg-type]
    exported: list[dict[str, Any]] = []

    def agent(url: str, task: dict[str, Any]) -> Any:
        exported.append(hooks.export_episode(EPISODE))  # while it runs: exported
        raise RuntimeError("the agent crashed")

    hooks = GatewayHooks(served, FunctionAgent(agent, lambda session: ""))
    with pytest.raises(RuntimeError, match="the agent crashed"):
        await hooks.run_episode(RunEpisode(episode=EPISODE), Episode())  # type: ignore[arg-type]
    assert exported and exported[0]["rollout_id"] == EPISODE.rollout_id
    with pytest.raises(InvalidInput, match="holds no session of episode"):
        hooks.export_episode(EPISODE)
