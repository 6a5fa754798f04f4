"""``rollsafe demo --gym workplace_assistant``: NeMo Gym's own simple_agent and
workplace_assistant resources server, unmodified, as the run's environments.

Each environment instance is three processes, four on NeMo Gym 0.7: ``rollsafe gateway serve``
(the checkpoint participant the controller dispatches episodes to, the model the agent calls,
and the proxy in front of the tools), and NeMo Gym's simple_agent and workplace_assistant in the
gym venv (:class:`rollsafe.gym.servers.GymServers`), on 0.7 with its legacy_agent environment
server in front of the agent, where each episode's ``/run`` goes. The engine is the scripted
policy (a tiny random model never calls a tool): per task it creates one calendar event,
searches the calendar for it, and answers. The trainer trains the tiny model whose tokenizer the
gateway and the engine use, on every call's prompt and generated tokens; the scripted engine
takes its weights and keeps saying what it is told, so the rewards are the script's, not
learned.

What the evidence shows: each task's event is in the session's calendar exactly once, as the
agent's search saw it (``env_mutations.jsonl``: one line per event found, so an effect made
twice is two lines for one turn, and ``rollsafe verify`` names it), whatever was killed; and
``/verify`` scores the agent's calls against the task's ground truth (reward 1.0).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from rollsafe.engine.vllm.models import ModelSpec
from rollsafe.env.protocol import EpisodeResult
from rollsafe.errors import InvalidInput
from rollsafe.evidence.files import EnvMutation
from rollsafe.gateway.serve import GATEWAY_BANNER
from rollsafe.gym.servers import WORKPLACE, GymServers, free_ports
from rollsafe.http.served import ServedProcess, start_served
from rollsafe.reference.rl.trainer import Sample
from rollsafe.reference.rl.workloads import MUTATIONS_COLUMN, mutations_column

# Fewer instances than the token-id demo's three: each is three or four processes here.
GYM_INSTANCES = ("w0", "w1")
SENTINEL = "rollsafe sentinel"
CREATE, SEARCH = "calendar_create_event", "calendar_search_events"
ANSWER = "The meeting is on the calendar."
# The model calls after the mutation (the first call makes it): run@step<k> holds each
# mid-generation until a cut, so the snapshot before the kill finds episodes whose tool effect
# is made and whose next call is cut, and the kill finds them still in flight.
HELD_CALL, HELD_AFTER_TOKENS = r"/t[1-9][0-9]*$", 3
# The tiny model the trainer trains (its tokenizer is the gateway's and the engine's). Prompts
# are the task's two tool schemas and a few messages: well inside max_positions.
MODEL_SPEC = ModelSpec(hidden_size=32, layers=1, heads=1, kv_heads=1, max_positions=4096)


def event_name(group_idx: int) -> str:
    return f"{SENTINEL} {group_idx}"


def _tool_call(name: str, arguments: Mapping[str, str]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n</tool_call>"


def _create_arguments(event: str) -> dict[str, str]:
    return {
        "event_name": event,
        "participant_email": "carlos@atlas.com",
        "event_start": "2023-12-01 10:00:00",
        "duration": "30",
    }


def script() -> dict[str, Any]:
    """The scripted policy (``engine serve --backend scripted --script``): rules on the
    prompt's last message, the first match wins. The event's name comes from the task's
    words (a group of the rule's pattern), so one script serves every task."""
    return {
        "format_version": 1,
        "rules": [
            {"when": f"<tool_response>[\\s\\S]*{SENTINEL}", "reply": ANSWER},  # it was found
            {"when": "<tool_response>", "reply": _tool_call(SEARCH, {"query": SENTINEL})},
            {
                "when": "Put '(?P<event>[^']+)' on my calendar",
                # After json.dumps: it would escape the reference's backslash.
                "reply": _tool_call(CREATE, _create_arguments("@event@")).replace(
                    "@event@", "\\g<event>"
                ),
            },
        ],
    }


@cache
def _dataset_row() -> dict[str, Any]:
    """The first row of NeMo Gym's own workplace_assistant example data: its system prompt
    and tool schemas are the tasks'."""
    return WORKPLACE.example_rows()[0]


def gym_task(group_idx: int) -> dict[str, Any]:
    """The body of simple_agent's ``/run`` for dataset index ``group_idx``: put its event on the
    calendar; the ground truth ``/verify`` scores against is that one creation."""
    row = _dataset_row()
    params = row["responses_create_params"]
    event = event_name(group_idx)
    user = (
        f"Put '{event}' on my calendar with carlos@atlas.com on 2023-12-01 at 10:00 for "
        "30 minutes, then check that it is there."
    )
    arguments = json.dumps(_create_arguments(event))
    return {
        "responses_create_params": {
            "input": [params["input"][0], {"role": "user", "content": user}],
            "tools": [t for t in params["tools"] if t["name"] in (CREATE, SEARCH)],
            "parallel_tool_calls": False,
            "temperature": 1.0,
        },
        "ground_truth": [{"name": CREATE, "arguments": arguments}],
        # What workplace_assistant's /verify requires besides: the dataset's own values.
        "id": group_idx,
        "category": row["category"],
        "environment_name": row["environment_name"],
    }


class GymWorkload:
    """Rows of the gateway's episode results: every model call's prompt and generated tokens."""

    def task(self, group_idx: int) -> dict[str, Any]:
        return gym_task(group_idx)

    def row(
        self, result: EpisodeResult, task: Mapping[str, Any], instance: str, rollout_id: str
    ) -> dict[str, np.ndarray]:
        calls = result.info["calls"]
        prompts = [list(c["prompt_token_ids"]) for c in calls]
        generated = [list(c["generation_token_ids"]) for c in calls]
        event = json.loads(task["ground_truth"][0]["arguments"])["event_name"]
        return {
            "prompt_tokens": np.array([t for p in prompts for t in p], np.int32),
            "prompt_lengths": np.array([len(p) for p in prompts], np.int32),
            "tokens": np.array([t for g in generated for t in g], np.int32),
            "turn_lengths": np.array([len(g) for g in generated], np.int32),
            "reward": np.array(result.reward, np.float32),
            "restored_prefix_tokens": np.array(sum(c["resumed_tokens"] for c in calls), np.int32),
            MUTATIONS_COLUMN: mutations_column(_events_found(result, event, instance, rollout_id)),
        }

    def samples(self, rollout_id: str, row: Mapping[str, Any]) -> list[Sample]:
        prompts = _split(row["prompt_tokens"], row["prompt_lengths"], rollout_id, "prompt")
        generated = _split(row["tokens"], row["turn_lengths"], rollout_id, "generated")
        if len(prompts) != len(generated):
            raise InvalidInput(f"{rollout_id}: {len(prompts)} prompts for {len(generated)} calls")
        reward = float(row["reward"])
        return [
            Sample(prompt_tokens=tuple(p), tokens=tuple(g), reward=reward)
            for p, g in zip(prompts, generated, strict=True)
        ]


def _split(flat: Any, lengths: Any, rollout_id: str, what: str) -> list[list[int]]:
    tokens, sizes = [int(t) for t in flat], [int(n) for n in lengths]
    if sum(sizes) != len(tokens):
        raise InvalidInput(f"{rollout_id}: the row's {what} lengths do not add up to its tokens")
    bounds = np.cumsum([0, *sizes]).tolist()
    return [tokens[a:b] for a, b in itertools.pairwise(bounds)]


def _events_found(
    result: EpisodeResult, event: str, instance: str, rollout_id: str
) -> list[EnvMutation]:
    """One line per copy of the task's event in the calendar the agent's last search returned
    (the resources server's state, not the gateway's record of calls). All on turn 0, the
    creation's: a creation applied twice is two lines for one turn, which ``verify`` names."""
    searches = [t for t in result.info["tool_calls"] if t["path"] == f"/{SEARCH}"]
    if not searches:
        raise InvalidInput(f"{rollout_id}: the agent never searched the calendar")
    reply = searches[-1]["reply"]
    found = _event_names(reply).count(event)
    if found == 0:
        raise InvalidInput(
            f"{rollout_id}: the calendar holds no {event!r}: its creation was lost "
            f"(the search found {reply[:200]})"
        )
    return [
        EnvMutation(instance=instance, rollout_id=rollout_id, turn=0, call_id=f"{event}#{copy}")
        for copy in range(found)
    ]


def _event_names(reply: str) -> list[Any]:
    """The names of the events a search reply lists (``{"output": {"events": [...]}}``; an
    output that is a sentence, "No events found.", lists none)."""
    try:
        output = json.loads(reply).get("output")
    except (json.JSONDecodeError, AttributeError):  # not JSON, or not an object
        return []
    events = output.get("events", []) if isinstance(output, dict) else []
    return [e.get("event_name") for e in events if isinstance(e, dict)]


def start_instance(
    name: str,
    engine_url: str,
    model: Path,
    logs: Path,
    env: Mapping[str, str],
    snapshot_root: Path | None,
) -> tuple[ServedProcess, GymServers]:
    """One environment instance: the gateway (started first, on the ports NeMo Gym's config
    names) and NeMo Gym's agent and resources server; returns both, the gateway first."""
    model_port, proxy_port = free_ports(2)
    gym = GymServers(logs / "gym", model_port=model_port, tool_proxy_port=proxy_port)
    host = "http://127.0.0.1"
    args = ["gateway", "serve", "--model", str(model), "--engine-url", engine_url]
    args += ["--agent-url", gym.run_url, "--agent-protocol", gym.agent_protocol]
    args += ["--tool-server", f"workplace={host}:{gym.ports.resources}"]
    args += ["--tool-port", f"workplace={proxy_port}", "--port", str(model_port)]
    args += ["--instance", name, "--lease-grace-s", "5"]
    if snapshot_root is not None:
        args += ["--snapshot-root", str(snapshot_root)]
    gateway = start_served(args, GATEWAY_BANNER.format(instance=name), logs / "gateway", env=env)
    try:
        gym.start()
    except BaseException:
        gateway.stop()
        raise
    return gateway, gym
