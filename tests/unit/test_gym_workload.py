"""The ``demo --gym`` workload without processes: its script routes each turn of an episode to
the right reply, a result becomes a row whose samples are every call's own tokens, and the
evidence of the calendar's state counts each copy of the task's event (a lost one refused)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollsafe.engine.scripted import Script
from rollsafe.env.protocol import EpisodeRef, EpisodeResult
from rollsafe.errors import InvalidInput
from rollsafe.reference.rl.gym_workplace import ANSWER, CREATE, SEARCH, GymWorkload, script
from rollsafe.reference.rl.workloads import mutations_of_row

EVENT = "rollsafe sentinel 12"
TASK = {"ground_truth": [{"name": CREATE, "arguments": json.dumps({"event_name": EVENT})}]}
ROLLOUT = "demo-s0-6_g1"


def _prompt(last: str) -> str:
    return f"<|im_start|>{last}<|im_end|>\n<|im_start|>assistant\n"


def test_the_script_creates_the_tasks_event_then_searches_then_answers() -> None:
    policy = Script.model_validate(script())
    create = policy.reply(_prompt(f"user\nPut '{EVENT}' on my calendar with carlos"))
    call = json.loads(create.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == CREATE and call["arguments"]["event_name"] == EVENT
    searched = policy.reply(_prompt('user\n<tool_response>\n{"output": "00000300"}'))
    assert f'"name": "{SEARCH}"' in searched
    found = f'user\n<tool_response>\n{{"output": {{"events": [{{"event_name": "{EVENT}"}}]}}}}'
    assert policy.reply(_prompt(found)) == ANSWER


def _result(search_reply: str, *, resumed: int = 0) -> EpisodeResult:
    calls = [
        {"prompt_token_ids": [1, 2, 3], "generation_token_ids": [7, 8], "resumed_tokens": 0},
        {"prompt_token_ids": [1, 2, 3, 7, 9], "generation_token_ids": [5], "resumed_tokens": 0},
        {"prompt_token_ids": [4], "generation_token_ids": [6, 6, 6], "resumed_tokens": resumed},
    ]
    tools: list[dict[str, Any]] = [
        {"server": "workplace", "path": f"/{CREATE}", "status": 200, "reply": '{"output":"1"}'},
        {"server": "workplace", "path": f"/{SEARCH}", "status": 200, "reply": search_reply},
    ]
    return EpisodeResult(
        episode=EpisodeRef(rollout_id=ROLLOUT, attempt=1),
        reward=1.0,
        turns=3,
        restored=True,
        info={"calls": calls, "tool_calls": tools},
    )


def _events(*names: str) -> str:
    # The resources server's spacing is its own: the count must not depend on it.
    return json.dumps({"output": {"events": [{"event_id": "1", "event_name": n} for n in names]}})


def test_a_row_gives_back_every_calls_own_prompt_and_tokens() -> None:
    workload = GymWorkload()
    row = workload.row(_result(_events(EVENT), resumed=2), TASK, "w1", ROLLOUT)
    samples = workload.samples(ROLLOUT, row)
    assert [(s.prompt_tokens, s.tokens) for s in samples] == [
        ((1, 2, 3), (7, 8)),
        ((1, 2, 3, 7, 9), (5,)),
        ((4,), (6, 6, 6)),
    ]
    assert {s.reward for s in samples} == {1.0} and int(row["restored_prefix_tokens"]) == 2
    [event] = mutations_of_row(row)
    assert (event.instance, event.rollout_id, event.turn) == ("w1", ROLLOUT, 0)


def test_each_copy_of_the_event_is_one_line_for_turn_zero() -> None:
    row = GymWorkload().row(
        _result(_events(EVENT, "rollsafe sentinel 1", EVENT)), TASK, "w0", ROLLOUT
    )
    events = mutations_of_row(row)
    assert [(e.turn, e.call_id) for e in events] == [(0, f"{EVENT}#0"), (0, f"{EVENT}#1")]


def test_an_event_the_calendar_lost_is_refused_by_name() -> None:
    with pytest.raises(InvalidInput, match=f"holds no '{EVENT}': its creation was lost"):
        GymWorkload().row(_result('{"output":"No events found."}'), TASK, "w0", ROLLOUT)


def test_a_row_whose_lengths_do_not_add_up_is_refused() -> None:
    workload = GymWorkload()
    row = workload.row(_result(_events(EVENT)), TASK, "w0", ROLLOUT)
    row["turn_lengths"] = row["turn_lengths"][:-1]
    with pytest.raises(InvalidInput, match="generated lengths do not add up"):
        workload.samples(ROLLOUT, row)
