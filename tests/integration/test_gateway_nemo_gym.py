"""NeMo Gym's own agent and tools, unmodified, checkpointed through rollsafe's gateway.

Real processes throughout: ``rollsafe engine serve --backend scripted`` (a policy that calls
the workplace tools: a tiny random model never would), ``rollsafe gateway serve`` (the model
NeMo Gym's simple_agent calls, the proxy in front of its workplace_assistant resources server,
and a checkpoint participant), and NeMo Gym's simple_agent and workplace_assistant in their own
venv: 0.7.0 on Python 3.13 with its legacy_agent environment server in front of simple_agent
(where the episode's ``/run`` goes, as NeMo RL runs an agent that owns its episode), and 0.4.0
on Python 3.12, the agent's ``/run`` itself. The episode: seed the session, create a calendar
event (not idempotent: max id + 1), search the calendar for it, answer.

The seed's test: the episode is parked by a real checkpoint while its model call after the
mutation is generating (the engine holds it), the call is cut, the session committed; every
process is SIGKILLed and started afresh; the restore brings the episode back as attempt 1 and
the agent's ``/run`` is sent again with the same body: the model call before the mutation is
answered from the record, the mutation is made once into the freshly seeded session, the cut
call resumes from its prefix; the calendar the agent searches holds the sentinel event exactly
once, and every call's tokens are those of an uninterrupted episode.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollsafe.engine.http import EngineClient
from rollsafe.engine.loop import HOLD_ENV, HoldRule
from rollsafe.engine.text import ChatCodec
from rollsafe.engine.vllm.models import ModelSpec, make_model
from rollsafe.env.client import EnvClient
from rollsafe.env.protocol import (
    CommitRequest,
    EpisodeRef,
    EpisodeResult,
    PrepareRequest,
    RestoreRequest,
    ResumeRequest,
    RunEpisode,
)
from rollsafe.gateway.serve import GATEWAY_BANNER
from rollsafe.gym.servers import (
    SESSION_STATE,
    SINGLE_TOOL_CALL,
    WORKPLACE,
    GymResources,
    GymServers,
    free_ports,
    gym_python,
)
from rollsafe.http.bearer import ENGINE_TOKEN_ENV, ENV_TOKEN_ENV
from rollsafe.http.served import ENGINE_BANNER, ServedProcess, rollsafe_command
from rollsafe.testing.gym import gym_release_venv
from rollsafe.testing.processes import Generation
from rollsafe.testing.waiting import eventually_async

SENTINEL = "rollsafe sentinel"
CREATE = {
    "name": "calendar_create_event",
    "arguments": {
        "event_name": SENTINEL,
        "participant_email": "carlos@atlas.com",
        "event_start": "2023-12-01 10:00:00",
        "duration": "30",
    },
}
SEARCH = {"name": "calendar_search_events", "arguments": {"query": SENTINEL}}
ANSWER = "The meeting is on the calendar."
# The policy: rules on the prompt's last message, first match wins.
SCRIPT = {
    "format_version": 1,
    "rules": [
        {"when": SENTINEL, "reply": ANSWER},  # the search's result names it
        {"when": "<tool_response>", "reply": f"<tool_call>\n{json.dumps(SEARCH)}\n</tool_call>"},
        {"when": "", "reply": f"<tool_call>\n{json.dumps(CREATE)}\n</tool_call>"},
    ],
}
SIMPLE_AGENT = "simple_agent"  # NeMo Gym's, in its own process, via --agent-url
OPENAI_AGENT = "examples.openai_agent:agent"  # a plain openai client, via --agent
HELD_CALL = "/t1"  # the model call after the mutation
HELD_AFTER = 3
TOOLS = "workplace"  # the tool server's name at the gateway (the openai agent's tools path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = ModelSpec(hidden_size=32, layers=1, heads=1, kv_heads=1, max_positions=32768)
    return make_model(tmp_path_factory.mktemp("gym-model") / "model", spec)


def example_task(venv: Path) -> dict[str, Any]:
    return WORKPLACE.example_rows(gym_python(venv))[0]


@dataclass(frozen=True)
class Setup:
    """Which resources server, the policy's script, and the call the engine holds."""

    resources: GymResources = WORKPLACE
    script: dict[str, Any] = field(default_factory=lambda: SCRIPT)
    held_call: str = HELD_CALL


class Stack(Generation):
    """One generation of every process: engine, gateway, NeMo Gym's agent and resources (and
    on 0.7 its environment server), from ``venv``."""

    def __init__(
        self,
        root: Path,
        model: Path,
        name: str,
        agent: str,
        venv: Path,
        *,
        hold: bool,
        ports: Any = None,
        setup: Setup = Setup(),
    ):
        self.agent, self.venv, self.setup = agent, venv, setup
        self.tokens = {ENGINE_TOKEN_ENV: "engine-secret", ENV_TOKEN_ENV: "env-secret"}
        logs = root / "logs" / name
        script = root / "script.json"
        script.write_text(json.dumps(setup.script))
        env = dict(self.tokens)
        if hold:
            rule = HoldRule(calls=setup.held_call, after_tokens=HELD_AFTER)
            env[HOLD_ENV] = rule.model_dump_json()
        super().__init__()
        try:
            self._start(logs, script, model, env, hold, ports)
        except BaseException:
            self.stop()
            raise

    def _start(
        self, logs: Path, script: Path, model: Path, env: dict[str, str], hold: bool, ports: Any
    ) -> None:
        host = "http://127.0.0.1"
        self.engine = ServedProcess(
            rollsafe_command(
                "engine",
                "serve",
                "--backend",
                "scripted",
                "--model",
                str(model),
                "--script",
                str(script),
                "--port",
                "0",
            ),
            logs / "engine",
            env,
        )
        self.started.append(self.engine)
        self.engine.wait_listening(ENGINE_BANNER.format(kind=r"\S+"))
        model_port, proxy_port = ports or free_ports(2)  # a restart keeps the agent's config
        simple_agent = self.agent == SIMPLE_AGENT  # else the openai example, in the gateway
        self.gym = GymServers(
            logs / "gym",
            model_port=model_port,
            tool_proxy_port=proxy_port,
            agent=simple_agent,
            venv=self.venv,
            resources=self.setup.resources,
        )
        self.ports = (self.gym.ports.model, self.gym.ports.tool_proxy)
        entry = (
            ["--agent-url", self.gym.run_url, "--agent-protocol", self.gym.agent_protocol]
            if simple_agent
            else ["--agent", OPENAI_AGENT]
        )
        self.gateway = ServedProcess(
            rollsafe_command(
                "gateway", "serve", "--model", str(model), "--engine-url", self.engine.url,
                *entry,
                "--tool-server", f"{TOOLS}={host}:{self.gym.ports.resources}",
                "--tool-port", f"{TOOLS}={self.gym.ports.tool_proxy}",
                "--port", str(self.gym.ports.model), "--instance", "gw-0",
                "--snapshot-root", str(logs.parents[1]), "--lease-grace-s", "5",
            ),
            logs / "gateway",
            self.tokens,
        )  # fmt: skip
        self.started.append(self.gateway)
        self.gateway.wait_listening(GATEWAY_BANNER.format(instance="gw-0"))
        self.started.append(self.gym)
        self.gym.start()
        self.env = EnvClient(self.gateway.url, self.tokens[ENV_TOKEN_ENV])
        self.engine_client = EngineClient(self.engine.url, self.tokens[ENGINE_TOKEN_ENV])


def _calls(result: Any) -> list[dict[str, Any]]:
    return [
        {k: call[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")}
        for call in result.info["calls"]
    ]


@pytest.mark.parametrize(
    ("agent", "release"),
    [(SIMPLE_AGENT, "0.7"), (SIMPLE_AGENT, "0.4"), (OPENAI_AGENT, "0.7")],
    ids=["simple_agent-0.7-legacy_agent", "simple_agent-0.4", "openai-0.7"],
)
async def test_episode_survives_a_kill_of_every_process(
    tmp_path: Path, model_dir: Path, stacks: list[Stack], agent: str, release: str
) -> None:
    codec = ChatCodec.load(model_dir)
    venv = gym_release_venv(release)
    task = example_task(venv)
    episode = EpisodeRef(rollout_id="gym-0_g0", attempt=0)
    first = Stack(tmp_path, model_dir, "first", agent, venv, hold=True)
    stacks.append(first)
    # 0.7's simple_agent is reached through its environment server (the relay), 0.4's directly.
    via_relay = agent == SIMPLE_AGENT and release == "0.7"
    assert (first.gym.ports.environment is not None) == via_relay
    second, restored = await _killed_and_restored(tmp_path, model_dir, stacks, episode, task)

    # The mutation once: the calendar the agent searched (the last prompt) holds one sentinel.
    searched = codec.decode(restored.info["calls"][-1]["prompt_token_ids"]).rsplit(
        "<tool_response>", 1
    )[1]
    assert searched.count(SENTINEL) == 1, searched
    assert restored.reward == 0.0  # the dataset's task wanted something else: scored all the same

    # Token for token what an uninterrupted episode of the same task makes.
    fresh = await second.env.run_episode(
        RunEpisode(episode=EpisodeRef(rollout_id="gym-1_g0", attempt=0), task=task)
    )
    assert _calls(restored) == _calls(fresh)
    assert [t["path"] for t in restored.info["tool_calls"]] == [
        "/seed_session", "/calendar_create_event", "/calendar_search_events", "/verify",
    ]  # fmt: skip

    # The superseded attempt's session reaches nothing: its tool call is refused at the proxy.
    proxy = f"http://127.0.0.1:{second.ports[1]}"
    async with httpx.AsyncClient() as http:
        late = await http.post(
            f"{proxy}/calendar_create_event",
            json=CREATE["arguments"],
            headers={"cookie": f"rollsafe_session={episode.key}"},
        )
    assert late.status_code == 409 and "session_ended" in late.text


async def _killed_and_restored(
    tmp_path: Path, model_dir: Path, stacks: list[Stack], episode: EpisodeRef, task: Any
) -> tuple[Stack, EpisodeResult]:
    """The seed's drill on ``stacks[-1]``: the episode runs until the engine holds its call
    after the mutation; a real checkpoint parks it there, the call is cut, the session
    committed; every process is SIGKILLed; a second generation of them restores the episode
    as attempt 1 and runs it. Returns that stack and the restored run's result."""
    first = stacks[-1]
    running = asyncio.create_task(first.env.run_episode(RunEpisode(episode=episode, task=task)))
    await eventually_async(lambda: _held(first), what="the call after the mutation held")

    parked = await first.env.prepare(
        PrepareRequest(checkpoint_id="ck-1", deadline_ts=time.time() + 30)
    )
    assert parked.ready and [p.activity for p in parked.parked] == ["generating"]
    call_id = parked.parked[0].model_call_id
    assert call_id == f"{episode.key}{first.setup.held_call}"
    cut = await first.engine_client.cut([call_id])
    [prefix] = cut.prefixes
    assert len(prefix.tokens) == HELD_AFTER
    dest = tmp_path / "snap" / "envs" / "gw-0"
    await first.env.commit(CommitRequest(checkpoint_id="ck-1", scope=(episode,), dest=str(dest)))

    first.crash()  # every process: engine, gateway, agent, resources server
    running.cancel()
    with pytest.raises((asyncio.CancelledError, Exception)):
        await running

    second = Stack(
        tmp_path, model_dir, "second", first.agent, first.venv,
        hold=False, ports=first.ports, setup=first.setup,
    )  # fmt: skip
    stacks.append(second)
    restore = RestoreRequest(
        restore_id="rs-1",
        source_checkpoint_id="ck-1",
        root=str(dest),
        scope=(episode,),
        prefixes={call_id: prefix.model_dump(mode="json")},
        deadline_ts=time.time() + 30,
    )
    assert (await second.env.restore(restore)).restored == (episode.next_attempt(),)
    await second.env.resume(ResumeRequest(checkpoint_id="rs-1"))
    restored = await second.env.run_episode(RunEpisode(episode=episode.next_attempt(), task=task))
    assert restored.restored and "fell_back" not in restored.info
    assert restored.info["replayed_calls"] == 1  # the call before the mutation, from the record
    resumed = [call["resumed_tokens"] for call in restored.info["calls"]]
    assert resumed[1] == HELD_AFTER and sum(resumed) == HELD_AFTER  # the held call, from its cut
    return second, restored


# example_session_state_mgmt: a counter per session, increment_counter not idempotent, /verify
# scoring the count (NeMo Gym's own example server, unmodified).
COUNTER_SCRIPT = {
    "format_version": 1,
    "rules": [
        {"when": '"count"', "reply": "The count is 6."},  # get_counter_value's reply
        {
            "when": "success",  # increment_counter's reply
            "reply": '<tool_call>\n{"name": "get_counter_value", "arguments": {}}\n</tool_call>',
        },
        {
            "when": "",
            "reply": '<tool_call>\n{"name": "increment_counter", "arguments": {"count": 3}}'
            "\n</tool_call>",
        },
    ],
}


def counter_task(venv: Path) -> dict[str, Any]:
    """Its example row's tools, asking for one increment: 3 + 3 must make 6."""
    [row, *_] = SESSION_STATE.example_rows(gym_python(venv))
    params = {**row["responses_create_params"], "input": [{"role": "user", "content": "add 3"}]}
    return {"responses_create_params": params, "initial_count": 3, "expected_count": 6}


async def test_a_counter_counts_each_increment_once_across_a_kill_of_every_process(
    tmp_path: Path, model_dir: Path, stacks: list[Stack]
) -> None:
    """NeMo Gym 0.7's example_session_state_mgmt behind the gateway, simple_agent behind its
    legacy_agent environment server: the counter the restored episode verifies was incremented
    once (the killed server's count died with it; the record's increment is made once into the
    freshly seeded session), so /verify's reward is 1.0; twice would be 9 and 0.0."""
    venv = gym_release_venv("0.7")
    setup = Setup(resources=SESSION_STATE, script=COUNTER_SCRIPT)
    stacks.append(Stack(tmp_path, model_dir, "first", SIMPLE_AGENT, venv, hold=True, setup=setup))
    episode = EpisodeRef(rollout_id="count-0_g0", attempt=0)
    _, restored = await _killed_and_restored(
        tmp_path, model_dir, stacks, episode, counter_task(venv)
    )
    assert [t["path"] for t in restored.info["tool_calls"]] == [
        "/seed_session", "/increment_counter", "/get_counter_value", "/verify",
    ]  # fmt: skip
    assert json.loads(restored.info["tool_calls"][2]["reply"]) == {"count": 6}
    assert restored.reward == 1.0


# example_single_tool_call: NeMo Gym 0.7's pairing migrated to its single_agent_turn environment
# server, which owns the episode (typed episode protocol): it seeds the resources session itself
# (through the proxy, which finds the session by the episode the seed names), seeds an agent
# session granting it the tools, makes one agent turn, verifies, closes both sessions.
WEATHER_SCRIPT = {
    "format_version": 1,
    "rules": [
        {"when": "cold", "reply": "It is cold in San Francisco."},  # get_weather's reply
        {
            "when": "",
            "reply": '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"San Francisco"}}\n</tool_call>',
        },
    ],
}


async def test_single_agent_turn_owns_the_episode_and_it_survives_a_kill_of_every_process(
    tmp_path: Path, model_dir: Path, stacks: list[Stack]
) -> None:
    venv = gym_release_venv("0.7")
    setup = Setup(resources=SINGLE_TOOL_CALL, script=WEATHER_SCRIPT)
    first = Stack(tmp_path, model_dir, "first", SIMPLE_AGENT, venv, hold=True, setup=setup)
    stacks.append(first)
    assert first.gym.agent_protocol == "episode"  # its /run takes the typed episode request
    [task, *_] = SINGLE_TOOL_CALL.example_rows(gym_python(venv))
    episode = EpisodeRef(rollout_id="weather-0_g0", attempt=0)
    _, restored = await _killed_and_restored(tmp_path, model_dir, stacks, episode, task)
    # Its resources session seeded, verified and closed through the proxy, its tool called
    # by the agent with the access the environment server granted; the seed's fresh
    # resources_session_id is the attempt's, not a divergence.
    assert [t["path"] for t in restored.info["tool_calls"]] == [
        "/seed_session", "/get_weather", "/verify", "/close_session",
    ]  # fmt: skip
    assert restored.reward == 1.0 and restored.turns == 2


async def _held(stack: Stack) -> bool:
    return (await stack.engine_client.info()).held == 1
