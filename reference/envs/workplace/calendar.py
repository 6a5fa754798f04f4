"""The workplace calendar: pure state, actions, prompts and reward. No I/O, no clock, no RNG
state: every function is a function of its arguments, so a restored episode recomputes exactly
what the original would have.

A day has :data:`SLOTS` slots. A calendar starts with a few *busy* blocks drawn from the task's
seed; the policy adds, moves and deletes *meetings*. Any list of generated tokens maps to a
valid action (:func:`action_from_tokens`), so even a random policy always makes valid calls.
The reward is the fraction of the requested meetings scheduled without overlapping anything.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollsafe.errors import InvalidInput, InvariantError

SLOTS = 16
MAX_DURATION = 3
TITLES = 32
VOCAB = 512  # the reference engine's vocabulary: every prompt token is below it
OPS = ("add_event", "move_event", "delete_event")
Op = Literal["add_event", "move_event", "delete_event"]

# Prompt token layout: a marker, then small fields offset into disjoint ranges below VOCAB.
BOS, TASK, BUSY, ACT, TURN = 1, 2, 3, 4, 5


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Task(_Frozen):
    """What ``RunEpisode.task`` holds; every field has a default, so ``{}`` is a task."""

    seed: int = Field(default=0, ge=0, lt=2**31)
    meetings: int = Field(default=3, ge=1, le=8, description="meetings to schedule")
    turns: int = Field(default=4, ge=1, le=16, description="tool calls the episode makes")


def describe(exc: ValidationError) -> str:
    """One line: each problem as ``field.path: message``."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or '<value>'}: {e['msg']}" for e in exc.errors()[:10]
    )


def parse_task(raw: Mapping[str, Any]) -> Task:
    try:
        return Task.model_validate(dict(raw))
    except ValidationError as exc:
        raise InvalidInput(f"bad workplace task: {describe(exc)}") from None


class Event(_Frozen):
    id: int = Field(ge=0)
    kind: Literal["busy", "meeting"]
    slot: int = Field(ge=0, lt=SLOTS)
    duration: int = Field(ge=1, le=MAX_DURATION)
    title: int = Field(default=0, ge=0, lt=TITLES)

    @model_validator(mode="after")
    def _fits(self) -> Event:
        if self.slot + self.duration > SLOTS:
            raise ValueError(f"event {self.id} ends after slot {SLOTS}")
        return self

    def overlaps(self, other: Event) -> bool:
        return self.slot < other.slot + other.duration and other.slot < self.slot + self.duration


class Action(_Frozen):
    """One tool call. ``target`` is the event id a move or delete acts on."""

    op: Op
    slot: int = Field(default=0, ge=0, lt=SLOTS)
    duration: int = Field(default=1, ge=1, le=MAX_DURATION)
    title: int = Field(default=0, ge=0, lt=TITLES)
    target: int | None = None


class Mutation(_Frozen):
    """One applied action, keyed by ``(rollout_id, turn, call_id)``: the applied-mutation log."""

    rollout_id: str
    turn: int = Field(ge=0)
    call_id: str
    op: Op
    event: int = Field(ge=0, description="the event added, moved or deleted")
    slot: int = Field(ge=0, lt=SLOTS)
    duration: int = Field(ge=1, le=MAX_DURATION)


class Calendar(_Frozen):
    events: tuple[Event, ...] = ()
    next_id: int = Field(default=0, ge=0)
    mutations: tuple[Mutation, ...] = ()

    def meetings(self) -> list[Event]:
        return [e for e in self.events if e.kind == "meeting"]

    def event(self, event_id: int) -> Event | None:
        return next((e for e in self.events if e.id == event_id), None)


def _draw(seed: int, index: int) -> int:
    # A hash, not random.Random: the same numbers on every Python and platform, statelessly.
    return int.from_bytes(hashlib.sha256(f"workplace:{seed}:{index}".encode()).digest()[:8], "big")


def new_calendar(task: Task) -> Calendar:
    """The episode's sandbox: one to three non-overlapping busy blocks drawn from the seed."""
    events: list[Event] = []
    for i in range(1 + _draw(task.seed, 0) % 3):
        duration = 1 + _draw(task.seed, 2 * i + 1) % 2
        block = Event(
            id=len(events),
            kind="busy",
            slot=_draw(task.seed, 2 * i + 2) % (SLOTS - duration + 1),
            duration=duration,
        )
        if not any(block.overlaps(e) for e in events):
            events.append(block)
    return Calendar(events=tuple(events), next_id=len(events))


def action_from_tokens(tokens: Sequence[int], calendar: Calendar) -> Action:
    """A valid action for any token list (short ones are padded with zeros). A move or delete
    with no meeting to act on falls back to an add."""
    t = [*tokens[:4], 0, 0, 0, 0][:4]
    op = OPS[t[0] % len(OPS)]
    meetings = sorted(calendar.meetings(), key=lambda e: e.id)
    if op != "add_event" and not meetings:
        op = "add_event"
    if op == "add_event":
        duration = 1 + t[2] % MAX_DURATION
        slot = t[1] % (SLOTS - duration + 1)
        return Action(op="add_event", slot=slot, duration=duration, title=t[3] % TITLES)
    target = meetings[t[3] % len(meetings)]
    if op == "move_event":
        slot = t[1] % (SLOTS - target.duration + 1)
        return Action(op="move_event", slot=slot, duration=target.duration, target=target.id)
    return Action(op="delete_event", slot=target.slot, duration=target.duration, target=target.id)


def apply(
    calendar: Calendar, action: Action, *, rollout_id: str, turn: int, call_id: str
) -> Calendar:
    """``calendar`` with ``action`` applied, once: the same ``(rollout_id, turn, call_id)``
    again returns ``calendar`` unchanged. A second, different call for a turn that already
    mutated is an invariant error (a turn makes one tool call)."""
    for done in calendar.mutations:
        if (done.rollout_id, done.turn, done.call_id) == (rollout_id, turn, call_id):
            return calendar
        if (done.rollout_id, done.turn) == (rollout_id, turn):
            raise InvariantError(
                f"turn {turn} of {rollout_id} already mutated by call {done.call_id!r}, "
                f"not {call_id!r}"
            )
    events = list(calendar.events)
    next_id = calendar.next_id
    if action.op == "add_event":
        changed = Event(
            id=next_id,
            kind="meeting",
            slot=action.slot,
            duration=action.duration,
            title=action.title,
        )
        events.append(changed)
        next_id += 1
    else:
        target = calendar.event(action.target) if action.target is not None else None
        if target is None or target.kind != "meeting":
            raise InvalidInput(f"{action.op}: no meeting with id {action.target}")
        events.remove(target)
        changed = target
        if action.op == "move_event":
            try:
                changed = target.model_copy(update={"slot": action.slot})
                changed = Event.model_validate(changed.model_dump())  # re-check that it fits
            except ValidationError as exc:
                raise InvalidInput(f"move_event: {exc}") from None
            events.append(changed)
    mutation = Mutation(
        rollout_id=rollout_id,
        turn=turn,
        call_id=call_id,
        op=action.op,
        event=changed.id,
        slot=changed.slot,
        duration=changed.duration,
    )
    return Calendar(
        events=tuple(sorted(events, key=lambda e: e.id)),
        next_id=next_id,
        mutations=(*calendar.mutations, mutation),
    )


def reward(calendar: Calendar, task: Task) -> float:
    """Requested meetings scheduled without overlapping any other event, as a fraction."""
    clear = [
        m for m in calendar.meetings() if not any(m.overlaps(e) for e in calendar.events if e != m)
    ]
    return min(len(clear), task.meetings) / task.meetings


def prompt(task: Task, calendar: Calendar, turn: int) -> tuple[int, ...]:
    """The policy's prompt for ``turn``: task, busy blocks, the actions so far, the turn."""
    tokens = [BOS, TASK, 16 + task.meetings, 32 + task.turns]
    tokens += [64 + task.seed % 64, 128 + (task.seed // 64) % 64]
    for e in calendar.events:
        if e.kind == "busy":
            tokens += [BUSY, 192 + e.slot, 208 + e.duration]
    for m in calendar.mutations:
        tokens += [ACT, 256 + OPS.index(m.op), 272 + m.slot, 288 + m.duration, 320 + m.event % 64]
    tokens += [TURN, 384 + turn]
    assert all(0 <= t < VOCAB for t in tokens)  # the layout above keeps every field in range
    return tuple(tokens)
