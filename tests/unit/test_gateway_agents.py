"""How the gateway starts an episode on NeMo Gym 0.7's typed episode protocol (pure): the
request names the episode and a task id that outlives the attempt; a result is the reward and
its fields, a failure raised by whether it may be tried again; the ids an environment server
makes per attempt (resources_session_id, episode_id) are no divergence on replay."""

from __future__ import annotations

import json

import pytest

from rollsafe.env.protocol import EpisodeRef
from rollsafe.errors import EnvUnavailable, InvalidInput
from rollsafe.gateway.agents import episode_outcome, episode_request
from rollsafe.gateway.record import body_digest

ROW = {"responses_create_params": {"input": "what's it like in sf?"}, "expected": "cold"}
FIRST = EpisodeRef(rollout_id="weather-0_g0", attempt=0)


def test_the_request_names_the_episode_and_a_task_id_that_outlives_the_attempt() -> None:
    first = episode_request(ROW, FIRST.key, FIRST)
    again = episode_request(ROW, FIRST.next_attempt().key, FIRST.next_attempt())
    assert first["episode_id"] == {"rollout_id": "weather-0_g0", "attempt": 0}
    assert again["episode_id"] == {"rollout_id": "weather-0_g0", "attempt": 1}
    assert first["task"]["task_id"] == again["task"]["task_id"]
    task_input = first["task"]["task_input"]
    assert task_input["expected"] == "cold"  # flat: 0.7's task input takes it as task_data
    assert task_input["responses_create_params"]["metadata"] == {"rollsafe_session": FIRST.key}
    assert "metadata" not in ROW["responses_create_params"]  # the run's task is not touched


def test_a_result_is_its_reward_and_a_failure_is_raised_by_whether_to_try_again() -> None:
    typed = {"episode_id": {}, "task_id": {}, "result": {"reward": 1.0, "mask_sample": False}}
    outcome = episode_outcome(typed, "env")
    assert outcome.reward == 1.0 and outcome.info["mask_sample"] is False
    assert episode_outcome({"reward": 0.5}, "env").reward == 0.5  # a legacy adapter's flat one
    failed = {"stage": "agent", "failure_reason": "the agent is gone", "terminal": False}
    with pytest.raises(EnvUnavailable, match="failed the episode at its agent stage: the agent"):
        episode_outcome({"episode_id": {}, "task_id": {}, "failure": failed}, "env")
    legacy = {"_ng_failure_class": "x", "_ng_failure_terminal": True, "_ng_failure_stage": "seed"}
    with pytest.raises(InvalidInput, match="at its seed stage"):
        episode_outcome({**legacy, "_ng_failure_message": "no session"}, "env")
    with pytest.raises(InvalidInput, match="no numeric 'reward'"):
        episode_outcome({"episode_id": {}, "result": {"score": 1}}, "env")


def test_the_ids_an_environment_server_makes_per_attempt_are_no_divergence() -> None:
    def seed(session_id: str, attempt: int, city: str = "sf") -> bytes:
        episode = {"rollout_id": "weather-0_g0", "attempt": attempt}
        body = {"resources_session_id": session_id, "episode_id": episode, "task_data": {"c": city}}
        return json.dumps(body).encode()

    assert body_digest(seed("resources-session-1", 0)) == body_digest(
        seed("resources-session-2", 1)
    )
    assert body_digest(seed("resources-session-1", 0)) != body_digest(seed("s", 0, city="nyc"))
