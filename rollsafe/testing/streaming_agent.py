"""An agent that streams, for the gateway's streaming tests: ``rollsafe gateway serve --agent
rollsafe.testing.streaming_agent:agent``.

It is a plain ``openai.AsyncOpenAI`` client given the session's base URL, as a user's agent is:
one model call, streamed, through chat completions (``create(stream=True)``) or the Responses
API (the SDK's ``responses.stream`` helper, which checks the events' order as it builds the
response). The task: ``{"api": "chat" | "responses", "prompt": str, "deltas": path?}``. Each
text delta it receives is appended to ``deltas`` as a JSON line as it arrives (a test watches
the file to see text come while the call is still generating). Its reply: the reward 1.0 with
the text it assembled, how many deltas made it, and the token ids the stream's last piece
carried.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai

MAX_TOKENS = 64


async def agent(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    deltas = Path(task["deltas"]) if task.get("deltas") else None
    received: list[str] = []

    def take(delta: str) -> None:
        received.append(delta)
        if deltas is not None:
            with deltas.open("a") as out:
                out.write(json.dumps(delta) + "\n")

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        if task["api"] == "chat":
            tokens = await _chat(client, task["prompt"], take)
        elif task["api"] == "responses":
            tokens = await _responses(client, task["prompt"], take)
        else:
            raise ValueError(f"api {task['api']!r}: expected 'chat' or 'responses'")
    return {"reward": 1.0, "text": "".join(received), "deltas": len(received), **tokens}


async def _chat(client: openai.AsyncOpenAI, prompt: str, take: Any) -> dict[str, Any]:
    stream = await client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    last: dict[str, Any] = {}
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            take(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason is not None:
            last = chunk.model_dump()  # the extra token fields ride on the finish chunk
    return {"generation_token_ids": last.get("generation_token_ids")}


async def _responses(client: openai.AsyncOpenAI, prompt: str, take: Any) -> dict[str, Any]:
    async with client.responses.stream(
        model="policy", input=prompt, max_output_tokens=MAX_TOKENS
    ) as stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                take(event.delta)
        final = await stream.get_final_response()
    item = final.output[-1].model_dump()
    return {"generation_token_ids": item.get("generation_token_ids"), "final": final.output_text}
