"""Malformed engine requests over HTTP (issue 32): a real reference engine (a tiny model)
behind the engine app on ``httpx.ASGITransport``. Each is a 422 naming the field, never a 5xx
or a retryable 503, and the engine serves a valid request right after."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from rollsafe.engine.http import engine_app
from rollsafe.engine.model import ModelConfig
from rollsafe.engine.protocol import GenerateRequest, SamplingParams, prompt_digest, seal_prefix
from rollsafe.engine.torch_engine import TorchEngine

TOKEN = "unit-token"
CONTEXT = 16
CONFIG = ModelConfig(
    vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_positions=CONTEXT
)
PROMPT = (1, 2, 3, 4)
REQUEST = GenerateRequest(
    call_id="c1", prompt_tokens=PROMPT, sampling=SamplingParams(seed=1, max_tokens=3)
)


@pytest.fixture
async def raw() -> AsyncIterator[httpx.AsyncClient]:
    async with TorchEngine(CONFIG, seed=0) as engine:
        transport = httpx.ASGITransport(app=engine_app(engine, TOKEN))
        headers = {"authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://engine.test", headers=headers
        ) as client:
            yield client


def body(**changes: Any) -> dict[str, Any]:
    """REQUEST as JSON, with ``changes`` (``sampling`` ones merged into its sampling)."""
    fields = REQUEST.model_dump(mode="json")
    fields["sampling"] |= changes.pop("sampling", {})
    return fields | changes


def events(response: httpx.Response) -> list[dict[str, Any]]:
    """A stream's events (the transport buffers it: the call has finished)."""
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def refused(response: httpx.Response, *named: str) -> str:
    assert response.status_code == 422, response.text
    reply = response.json()
    assert reply["error"] == "InvalidInput"
    for name in named:
        assert name in reply["detail"], (name, reply["detail"])
    return str(reply["detail"])


async def test_an_empty_allowed_set_is_a_422_naming_the_field(raw: httpx.AsyncClient) -> None:
    """It was a 503 (EngineUnavailable, "retry") from the engine's sampler; the model refuses
    it now, for every engine alike."""
    empty = await raw.post("/v1/generate", json=body(sampling={"allowed_token_ids": []}))
    refused(empty, "sampling.allowed_token_ids")
    with pytest.raises(ValidationError, match="allowed_token_ids"):
        SamplingParams(seed=1, allowed_token_ids=())
    one = await raw.post("/v1/generate", json=body(sampling={"allowed_token_ids": [7]}))
    *tokens, finish = events(one)
    assert [t["token"] for t in tokens] == [7, 7, 7] and finish["n_tokens"] == 3


async def test_prompt_plus_max_tokens_past_the_context_is_a_422_naming_the_limit(
    raw: httpx.AsyncClient,
) -> None:
    huge = await raw.post("/v1/generate", json=body(sampling={"max_tokens": 10**12}))
    detail = refused(huge, "sampling.max_tokens", f"{CONTEXT} positions")
    assert f"at most {CONTEXT - len(PROMPT)}" in detail
    one_over = body(sampling={"max_tokens": CONTEXT - len(PROMPT) + 1})
    refused(await raw.post("/v1/generate", json=one_over), "sampling.max_tokens")
    full = body(prompt_tokens=[1] * CONTEXT, sampling={"max_tokens": 1})
    refused(await raw.post("/v1/generate", json=full), "prompt_tokens", f"{CONTEXT} positions")
    # Exactly the context: the call runs to its max_tokens, not cut short.
    fits = body(sampling={"max_tokens": CONTEXT - len(PROMPT)})
    finish = events(await raw.post("/v1/generate", json=fits))[-1]
    assert finish == {
        "kind": "finish",
        "call_id": "c1",
        "reason": "length",
        "n_tokens": CONTEXT - len(PROMPT),
        "detail": "",
    }


def resume_body(**request_changes: Any) -> dict[str, Any]:
    """A resume of REQUEST from a one-token prefix, as JSON."""
    prefix = seal_prefix(
        call_id=REQUEST.call_id,
        model=CONFIG.fingerprint(),
        prompt_digest=prompt_digest(PROMPT),
        sampling=REQUEST.sampling,
        tokens=(5,),
        logprobs=(-1.0,),
        weight_versions=(0,),
    )
    return {"request": body(**request_changes), "prefix": prefix.model_dump(mode="json")}


def with_prefix_tokens(tokens: list[Any]) -> dict[str, Any]:
    fields = resume_body()
    fields["prefix"]["tokens"] = tokens
    return fields


# Each: an int field given a bool, a float or a numeric string (lax validation took them).
NOT_INTS = [
    ("/v1/generate", body(prompt_tokens=[True, 2]), "prompt_tokens.0"),
    ("/v1/generate", body(prompt_tokens=[1.0, 2]), "prompt_tokens.0"),
    ("/v1/generate", body(prompt_tokens=["1", 2]), "prompt_tokens.0"),
    ("/v1/generate", body(sampling={"stop_token_ids": [True]}), "sampling.stop_token_ids.0"),
    ("/v1/generate", body(sampling={"allowed_token_ids": [3.0]}), "sampling.allowed_token_ids.0"),
    ("/v1/generate", body(sampling={"seed": True}), "sampling.seed"),
    ("/v1/generate", body(sampling={"max_tokens": 3.0}), "sampling.max_tokens"),
    ("/v1/generate", body(sampling={"max_tokens": "3"}), "sampling.max_tokens"),
    ("/v1/resume", resume_body(prompt_tokens=[1, True]), "request.prompt_tokens.1"),
    ("/v1/resume", with_prefix_tokens([True]), "prefix.tokens.0"),
]


@pytest.mark.parametrize(
    ("path", "sent", "field"), NOT_INTS, ids=[f"{p}:{f}" for p, _, f in NOT_INTS]
)
async def test_ints_are_strict_on_the_wire(
    raw: httpx.AsyncClient, path: str, sent: dict[str, Any], field: str
) -> None:
    refused(await raw.post(path, json=sent), field)
    valid = resume_body() if path == "/v1/resume" else body()
    assert events(await raw.post(path, json=valid))[-1]["kind"] == "finish"
