"""A plain ``openai``-client agent, checkpointed through rollsafe's gateway (docs/gateway.md).

Nothing in the agent knows about rollsafe: it is an ``openai.AsyncOpenAI`` chat-completions loop
with tools, given a base URL. Its tools are NeMo Gym's workplace_assistant resources server
(``/seed_session``, ``POST /{tool}``, ``/verify``), reached through the gateway's tool proxy
beside the base URL. The gateway runs it for every episode the run dispatches to it::

    rollsafe gateway serve --model DIR --engine-url http://127.0.0.1:8300 \\
        --agent examples.openai_agent:agent \\
        --tool-server workplace=http://127.0.0.1:9100 --port 8500

with ``base_url = http://127.0.0.1:8500/sessions/<session>/v1``: every model call and tool call
is in the episode's session, so a crash loses nothing and repeats no tool effect. The task is a
workplace_assistant dataset row (``responses_create_params``, ``ground_truth``, ...); the reward
is ``/verify``'s.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletionFunctionToolParam

TOOL_SERVER = "workplace"
MAX_STEPS = 6  # as NeMo Gym's simple_agent is configured for this environment


def chat_tools(row: dict[str, Any]) -> list[ChatCompletionFunctionToolParam]:
    """The row's Responses-API tools in the chat format."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool["name"],
                "description": tool.get("description", ""),
                "parameters": tool.get("parameters", {}),
            },
        }
        for tool in row["responses_create_params"]["tools"]
    ]


async def agent(base_url: str, row: dict[str, Any]) -> dict[str, Any]:
    """Run one episode of ``row`` against the model at ``base_url``; returns /verify's reply."""
    tools_url = base_url.removesuffix("/v1") + f"/tools/{TOOL_SERVER}"
    model = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list[Any] = list(row["responses_create_params"]["input"])
    calls: list[dict[str, Any]] = []
    created = 0
    async with httpx.AsyncClient(base_url=tools_url, timeout=None) as tools, model:
        (await tools.post("/seed_session", json=row)).raise_for_status()
        for _ in range(MAX_STEPS):
            reply = await model.chat.completions.create(
                model="policy", messages=messages, tools=chat_tools(row), max_tokens=256
            )
            message, created = reply.choices[0].message, reply.created
            messages.append(
                message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
            )
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                function = call.function  # type: ignore[union-attr]
                try:
                    arguments = json.loads(function.arguments)
                except ValueError as exc:  # the model's JSON is broken: say so, as a tool would
                    text = json.dumps({"error": f"arguments are not JSON: {exc}"})
                else:
                    text = (await tools.post(f"/{function.name}", json=arguments)).text
                messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
                calls.append(
                    {"name": function.name, "arguments": function.arguments, "id": call.id}
                )
        response = _response(calls, created)
        verify = await tools.post("/verify", json={**row, "response": response})
        verify.raise_for_status()
        return dict(verify.json())


def _response(calls: list[dict[str, Any]], created: int) -> dict[str, Any]:
    """The transcript as the Responses-API object /verify scores: its function calls. Nothing
    in it is the clock's: ``created`` is the last answer's, which a replay answers alike (the
    gateway refuses a replayed call that differs from the one it recorded)."""
    output = [
        {
            "type": "function_call",
            "call_id": call["id"],
            "id": call["id"],
            "name": call["name"],
            "arguments": call["arguments"],
            "status": "completed",
        }
        for call in calls
    ]
    return {
        "id": "resp_openai_agent",
        "object": "response",
        "created_at": created,
        "model": "policy",
        "output": output,
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
    }


if __name__ == "__main__":  # one episode by hand: python examples/openai_agent.py URL ROW.json
    import asyncio
    import sys

    with open(sys.argv[2]) as file:
        print(json.dumps(asyncio.run(agent(sys.argv[1], json.load(file)))))
