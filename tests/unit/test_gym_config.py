"""The NeMo Gym config rollsafe.gym builds (pure; nemo_gym's own validation of it runs in
tests/integration/test_nemo_gym_servers.py): each resources server's 0.7 pairing gets its
environment server (legacy_agent relaying to the agent; single_agent_turn seeding the resources
server through the proxy and granting the agent direct HTTP tools), and the sections are named
after the resources server."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollsafe.gym.servers import (
    SESSION_STATE,
    SINGLE_TOOL_CALL,
    WORKPLACE,
    GymPorts,
    GymResources,
    GymServers,
    gym_config,
)

PORTS = GymPorts(resources=1, agent=2, model=3, tool_proxy=4, environment=5)


@pytest.mark.parametrize("resources", [WORKPLACE, SESSION_STATE, SINGLE_TOOL_CALL])
def test_each_pairing_gets_its_environment_server(resources: GymResources) -> None:
    config = gym_config(PORTS, resources=resources)
    [(kind, relay)] = config[resources.environment_section]["environment_servers"].items()
    assert kind == resources.environment and relay["port"] == 5
    assert relay["agent_server"] == {
        "type": "responses_api_agents",
        "name": resources.agent_section,
    }
    agent = config[resources.agent_section]["responses_api_agents"]["simple_agent"]
    assert agent["resources_server"]["name"] == resources.tool_proxy_section
    assert ("max_steps" in agent) == (resources.max_steps is not None)
    if kind == "single_agent_turn":  # it seeds the resources session itself: through the proxy
        assert relay["resources_server"]["name"] == resources.tool_proxy_section
        assert relay["resources_tool_transports"] == ["direct_http"]
    else:
        assert "resources_server" not in relay


def test_what_run_url_speaks_follows_the_environment_server(tmp_path: Path) -> None:
    assert GymServers(tmp_path, resources=WORKPLACE).agent_protocol == "run"
    servers = GymServers(tmp_path, resources=SINGLE_TOOL_CALL)
    assert servers.agent_protocol == "episode" and servers.run_url.endswith(
        f":{servers.ports.environment}/run"
    )
    bare = GymServers(tmp_path, resources=SINGLE_TOOL_CALL, environment_server=False)
    assert bare.agent_protocol == "run" and bare.run_url.endswith(f":{bare.ports.agent}/run")
