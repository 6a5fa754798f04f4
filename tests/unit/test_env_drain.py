"""PendingReplies: the drain phase waits only for replies on the wire outside the commit scope."""

from __future__ import annotations

import asyncio
import time

from rollsafe.env.drain import PendingReplies
from rollsafe.env.protocol import EpisodeRef

A, B, C, D = (EpisodeRef(rollout_id=f"run-{i}_g0", attempt=0) for i in range(4))


def pending(*refs: EpisodeRef) -> PendingReplies:
    replies = PendingReplies()
    for i, ref in enumerate(refs):
        replies.add(ref, f"env-{i % 2}")
    return replies


def test_outside_selects_pending_not_in_scope() -> None:
    replies = pending(A, B, C)
    assert replies.outside({A.key, D.key}) == [B, C]  # D is in scope but not pending
    assert replies.outside({A.key, B.key, C.key}) == []
    assert replies.outside(set()) == [A, B, C]
    assert replies.instance_of(B.key) == "env-1"
    assert replies.instance_of(D.key) is None


def test_outside_keys_by_attempt() -> None:
    retry = A.next_attempt()
    replies = pending(retry)
    assert replies.outside({A.key}) == [retry]  # attempt 0 in scope says nothing of attempt 1
    assert replies.is_pending(retry.key) and not replies.is_pending(A.key)


async def test_wait_returns_when_the_last_is_done() -> None:
    replies = pending(A, B, C)

    async def answer() -> None:
        replies.done(B)
        await asyncio.sleep(0.005)
        replies.done(C)

    start = time.monotonic()
    answering = asyncio.create_task(answer())
    stragglers = await replies.wait_outside({A.key}, deadline_s=5.0)
    await answering
    assert stragglers == []
    assert time.monotonic() - start < 1.0  # woken by done, not by the deadline
    assert replies.is_pending(A.key)  # in scope: never waited for, still pending


async def test_wait_returns_at_once_when_nothing_outside() -> None:
    replies = pending(A)
    start = time.monotonic()
    assert await replies.wait_outside({A.key}, deadline_s=5.0) == []
    assert time.monotonic() - start < 0.1


async def test_deadline_returns_the_stragglers() -> None:
    replies = pending(A, B, C)

    async def answer() -> None:
        replies.done(B)

    answering = asyncio.create_task(answer())
    start = time.monotonic()
    stragglers = await replies.wait_outside({A.key}, deadline_s=0.02)
    await answering
    assert stragglers == [C]
    assert 0.015 <= time.monotonic() - start < 1.0
    assert replies.outside({A.key}) == [C]  # a straggler stays pending: the caller restarts it


async def test_added_outside_scope_while_waiting_is_waited_for() -> None:
    replies = pending(A, B)

    async def answer() -> None:
        replies.add(C, "env-0")  # sent before admission closed, recorded late
        replies.done(B)

    answering = asyncio.create_task(answer())
    stragglers = await replies.wait_outside({A.key}, deadline_s=0.02)
    await answering
    assert stragglers == [C]  # B's reply did not end the wait: C was still on the wire


def test_done_is_idempotent() -> None:
    replies = pending(A, B)
    replies.done(A)
    replies.done(A)
    replies.done(D)  # never added
    assert len(replies) == 1
    assert not replies.is_pending(A.key)
    assert replies.outside(set()) == [B]


def test_readded_after_done_is_pending_again() -> None:
    replies = pending(A)
    replies.done(A)
    assert not replies.is_pending(A.key)
    replies.add(A, "env-3")
    assert replies.is_pending(A.key)
    assert replies.instance_of(A.key) == "env-3"
    assert replies.outside(set()) == [A]
