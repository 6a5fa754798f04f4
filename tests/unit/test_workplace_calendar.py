"""The workplace calendar, pure: any tokens make a valid call, applying is idempotent per
(rollout, turn, call), the reward stays in [0, 1], and everything is deterministic."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollsafe.env.protocol import EpisodeRef
from rollsafe.errors import InvalidInput, InvariantError
from rollsafe.reference.envs.workplace.calendar import (
    SLOTS,
    VOCAB,
    Action,
    Calendar,
    Event,
    Task,
    action_from_tokens,
    apply,
    new_calendar,
    parse_task,
    prompt,
    reward,
)
from rollsafe.reference.envs.workplace.record import EpisodeRecord, parse_record

ROLLOUT = "wp-0_g0"
token_lists = st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=8)


def play(task: Task, turns: list[list[int]]) -> Calendar:
    calendar = new_calendar(task)
    for turn, tokens in enumerate(turns):
        action = action_from_tokens(tokens, calendar)
        calendar = apply(calendar, action, rollout_id=ROLLOUT, turn=turn, call_id=f"c/t{turn}")
    return calendar


def test_task_defaults_and_refusals() -> None:
    assert parse_task({}) == Task(seed=0, meetings=3, turns=4)
    for bad in ({"turns": 0}, {"meetings": 99}, {"seed": -1}, {"colour": "red"}):
        with pytest.raises(InvalidInput, match="bad workplace task"):
            parse_task(bad)


@given(seed=st.integers(0, 2**31 - 1))
def test_new_calendar_is_a_deterministic_sandbox_of_busy_blocks(seed: int) -> None:
    task = Task(seed=seed)
    calendar = new_calendar(task)
    assert calendar == new_calendar(task)
    assert 1 <= len(calendar.events) <= 3
    assert all(e.kind == "busy" for e in calendar.events)
    assert not any(a.overlaps(b) for a in calendar.events for b in calendar.events if a != b)
    assert calendar.next_id == len(calendar.events)


@settings(max_examples=200)
@given(seed=st.integers(0, 2**31 - 1), turns=st.lists(token_lists, max_size=16))
def test_any_tokens_make_valid_calls_and_a_bounded_deterministic_reward(
    seed: int, turns: list[list[int]]
) -> None:
    task = Task(seed=seed, turns=16)
    calendar = play(task, turns)  # apply raises on an invalid action: none may be produced
    assert calendar == play(task, turns)
    assert len(calendar.mutations) == len(turns)
    assert all(e.slot + e.duration <= SLOTS for e in calendar.events)
    assert 0.0 <= reward(calendar, task) <= 1.0
    assert all(0 <= t < VOCAB for t in prompt(task, calendar, len(turns)))


def test_move_and_delete_fall_back_to_add_without_meetings() -> None:
    calendar = new_calendar(Task())
    assert action_from_tokens([1, 5, 0, 0], calendar).op == "add_event"
    assert action_from_tokens([2, 5, 0, 0], calendar).op == "add_event"
    assert action_from_tokens([], calendar).op == "add_event"


def test_actions_map_tokens_to_ops_slots_and_targets() -> None:
    calendar = Calendar()
    calendar = apply(
        calendar,
        action_from_tokens([0, 3, 1, 7], calendar),
        rollout_id=ROLLOUT,
        turn=0,
        call_id="a",
    )
    (meeting,) = calendar.events
    assert (meeting.kind, meeting.slot, meeting.duration, meeting.title) == ("meeting", 3, 2, 7)
    move = action_from_tokens([1, 9, 0, 5], calendar)
    assert move == Action(op="move_event", slot=9, duration=2, target=meeting.id)
    moved = apply(calendar, move, rollout_id=ROLLOUT, turn=1, call_id="b")
    assert moved.events[0].slot == 9
    delete = action_from_tokens([2, 0, 0, 0], moved)
    assert apply(moved, delete, rollout_id=ROLLOUT, turn=2, call_id="c").events == ()
    assert [m.op for m in moved.mutations] == ["add_event", "move_event"]


def test_apply_is_idempotent_per_rollout_turn_and_call() -> None:
    calendar = new_calendar(Task())
    action = action_from_tokens([0, 4, 2, 1], calendar)
    once = apply(calendar, action, rollout_id=ROLLOUT, turn=0, call_id="k/t0")
    again = apply(once, action, rollout_id=ROLLOUT, turn=0, call_id="k/t0")
    assert again is once
    assert len(once.mutations) == 1
    with pytest.raises(InvariantError, match="already mutated"):
        apply(once, action, rollout_id=ROLLOUT, turn=0, call_id="k-a1/t0")


def test_apply_refuses_an_action_on_a_missing_or_busy_event() -> None:
    calendar = new_calendar(Task())
    busy = calendar.events[0].id
    for target in (busy, 99):
        with pytest.raises(InvalidInput, match="no meeting"):
            apply(
                calendar,
                Action(op="delete_event", target=target),
                rollout_id=ROLLOUT,
                turn=0,
                call_id="x",
            )


def test_reward_counts_requested_meetings_clear_of_overlap() -> None:
    task = Task(meetings=2)
    busy = Event(id=0, kind="busy", slot=0, duration=2)
    clear = Event(id=1, kind="meeting", slot=4, duration=1)
    clash = Event(id=2, kind="meeting", slot=1, duration=1)
    assert reward(Calendar(events=(busy,)), task) == 0.0
    assert reward(Calendar(events=(busy, clear, clash)), task) == 0.5
    extra = Event(id=3, kind="meeting", slot=8, duration=3)
    more = Event(id=4, kind="meeting", slot=12, duration=1)
    assert reward(Calendar(events=(busy, clear, extra, more)), task) == 1.0


def test_record_round_trips_and_refuses_inconsistent_state() -> None:
    task = Task(turns=2)
    record = EpisodeRecord(
        episode=EpisodeRef(rollout_id=ROLLOUT, attempt=0),
        task=task,
        turn=0,
        calendar=new_calendar(task),
    )
    dumped = record.model_dump(mode="json")
    assert parse_record(dumped) == record
    for bad in ({**dumped, "turn": 1}, {**dumped, "extra": 1}, {**dumped, "format": "x"}):
        with pytest.raises(InvalidInput, match="bad workplace record"):
            parse_record(bad)
