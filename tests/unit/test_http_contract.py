"""The contract on rollsafe's HTTP protocols (rollsafe.http.contract): a real engine app and
its real client over ``httpx.ASGITransport``; a peer one too many releases apart is refused by
name on either side, a peer of a release before contracts (no header) still works, and health
probes are answered whatever they send."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollsafe import versions
from rollsafe.engine.http import EngineClient, engine_app
from rollsafe.engine.model import ModelConfig
from rollsafe.engine.torch_engine import TorchEngine
from rollsafe.errors import VersionSkew
from rollsafe.http.contract import CONTRACT_HEADER, RELEASE_HEADER, ContractHeaders
from rollsafe.versions import CONTRACT

TOKEN = "unit-token"
CONFIG = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_positions=16)


@pytest.fixture
async def engine_transport() -> AsyncIterator[httpx.ASGITransport]:
    async with TorchEngine(CONFIG, seed=0) as engine:
        yield httpx.ASGITransport(app=engine_app(engine, TOKEN))


async def test_this_release_talks_to_itself_and_each_side_names_its_contract(
    engine_transport: httpx.ASGITransport,
) -> None:
    client = EngineClient("http://engine.test", TOKEN, transport=engine_transport)
    assert (await client.info()).kind == "dense"
    async with httpx.AsyncClient(transport=engine_transport, base_url="http://engine.test") as raw:
        health = await raw.get("/v1/health")
    assert health.headers[CONTRACT_HEADER] == str(CONTRACT)
    assert health.headers[RELEASE_HEADER] == versions.THIS.release
    await client.aclose()


@pytest.mark.parametrize("sent", [str(CONTRACT + 2), "soon"])
async def test_a_caller_too_far_apart_is_refused_by_name_and_health_still_answers(
    engine_transport: httpx.ASGITransport, sent: str
) -> None:
    headers = {"authorization": f"Bearer {TOKEN}", CONTRACT_HEADER: sent, RELEASE_HEADER: "9.9"}
    async with httpx.AsyncClient(
        transport=engine_transport, base_url="http://engine.test", headers=headers
    ) as raw:
        refused = await raw.get("/v1/info")
        health = await raw.get("/v1/health")
    assert refused.status_code == 409
    reply = refused.json()
    assert reply["error"] == "VersionSkew"
    assert reply["detail"].startswith("the caller is rollsafe 9.9 (contract ")
    assert (
        f"this process is rollsafe {versions.THIS.release} (contract {CONTRACT})" in reply["detail"]
    )
    assert health.status_code == 200


async def test_a_caller_before_contracts_is_served_while_one_apart(
    engine_transport: httpx.ASGITransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    headers = {"authorization": f"Bearer {TOKEN}"}  # no contract header: release 0.1.x
    async with httpx.AsyncClient(
        transport=engine_transport, base_url="http://engine.test", headers=headers
    ) as raw:
        assert (await raw.get("/v1/info")).status_code == 200
        monkeypatch.setattr(versions, "CONTRACT", 3)  # a later release: 0.1.x is two behind
        late = await raw.get("/v1/info")
    assert late.status_code == 409 and "contract 1" in late.json()["detail"]


def app_saying(headers: dict[str, str], *, strangers: bool = False) -> Starlette:
    async def info(request: object) -> JSONResponse:
        return JSONResponse({"kind": "never read"}, headers=headers)

    return Starlette(
        routes=[Route("/v1/info", info)],
        middleware=[Middleware(ContractHeaders, strangers=strangers)] if strangers else [],
    )


async def test_a_server_too_far_apart_is_refused_by_the_client_before_its_body() -> None:
    future = app_saying({CONTRACT_HEADER: str(CONTRACT + 2), RELEASE_HEADER: "9.9"})
    client = EngineClient("http://engine.test", TOKEN, transport=httpx.ASGITransport(app=future))
    with pytest.raises(VersionSkew) as skew:
        await client.info()
    assert str(skew.value).startswith("the server at http://engine.test is rollsafe 9.9")
    await client.aclose()


async def test_a_server_that_names_no_contract_is_left_to_its_body() -> None:
    """A release before contracts: its reply is parsed as before (here: not an engine's)."""
    silent = app_saying({})
    client = EngineClient("http://engine.test", TOKEN, transport=httpx.ASGITransport(app=silent))
    with pytest.raises(ValidationError, match="EngineInfo"):  # its body, parsed as before
        await client.info()
    await client.aclose()


async def test_strangers_are_served_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's OpenAI clients send no contract: never taken for an old rollsafe."""
    monkeypatch.setattr(versions, "CONTRACT", 3)
    app = app_saying({}, strangers=True)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gateway.test"
    ) as raw:
        served = await raw.get("/v1/info")
        named = await raw.get("/v1/info", headers={CONTRACT_HEADER: "1"})
    assert served.status_code == 200 and served.headers[CONTRACT_HEADER] == str(CONTRACT)
    assert named.status_code == 409
