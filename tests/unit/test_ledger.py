import hashlib
from collections.abc import Callable

import numpy as np
import pytest

from rollsafe.core.columns import in_key_order
from rollsafe.core.ledger import AttemptState, Ledger, RestartOutcome, RestoreLevel, seal_digest
from rollsafe.core.states import ATTEMPT_TRANSITIONS
from rollsafe.errors import (
    IllegalTransition,
    InvalidInput,
    LedgerInvariantViolation,
    SealConflict,
    SnapshotCorrupt,
    UnknownGroup,
)

A = AttemptState


def digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def ledger(
    level: RestoreLevel = RestoreLevel.SIBLING, groups: tuple[int, ...] = (7,), size: int = 2
) -> Ledger:
    led = Ledger("run", size)
    for idx in groups:
        led.reserve_group(idx, level)
    return led


def test_dispatch_then_seal() -> None:
    led = ledger()
    episode = led.dispatch(7, 0)
    assert episode.key == "run-7_g0"
    assert led.seal(7, 0, 0, digest("row")) is True
    assert led.state(7, 0) == A.SEALED
    assert led.digest(7, 0) == seal_digest(
        "run", 7, 0, 0, RestoreLevel.SIBLING, None, digest("row")
    )
    assert led.sealed_row_matches(7, 0, digest("row"))
    assert not led.sealed_row_matches(7, 0, digest("other row"))
    assert led.sealed(7) == [0] and led.unsealed(7) == [1]


def test_refused_dispatch_goes_back_to_reserved_without_spending_an_attempt() -> None:
    led = ledger()
    led.dispatch(7, 1)
    led.refuse(7, 1)
    assert led.state(7, 1) == A.RESERVED
    assert led.attempt(7, 1) == 0
    assert led.retirements() == []


def test_identical_seal_is_idempotent_and_different_seal_is_an_error() -> None:
    led = ledger()
    led.dispatch(7, 0)
    led.seal(7, 0, 0, digest("row"))
    assert led.seal(7, 0, 0, digest("row")) is False
    with pytest.raises(SealConflict, match="run-7_g0"):
        led.seal(7, 0, 0, digest("other"))
    assert led.sealed_row_matches(7, 0, digest("row"))


def test_seal_from_a_stale_attempt_is_refused() -> None:
    led = ledger()
    led.dispatch(7, 0)
    led.fail(7, 0)
    led.retry(7, 0)
    led.dispatch(7, 0)
    with pytest.raises(SealConflict, match="attempt 0 but the current attempt is 1"):
        led.seal(7, 0, 0, digest("late"))


def test_seal_needs_a_dispatched_attempt() -> None:
    led = ledger()
    with pytest.raises(IllegalTransition, match=r"run-7_g0.*RESERVED -> SEALED"):
        led.seal(7, 0, 0, digest("row"))


def test_abandon_queues_retirement_and_retry_keeps_the_rollout_id() -> None:
    led = ledger()
    led.dispatch(7, 0, owner="env-0")
    led.abandon(7, 0)
    (retirement,) = led.retirements()
    assert retirement.episode.key == "run-7_g0" and retirement.owner == "env-0"
    episode = led.retry(7, 0)
    assert episode.key == "run-7_g0-a1"
    assert episode.rollout == led.rollout_id(7, 0)
    led.mark_retired([retirement.episode])
    assert led.retirements() == []


def test_abandoning_a_reserved_attempt_retires_nothing() -> None:
    led = ledger()
    led.abandon(7, 0)
    assert led.retirements() == []


@pytest.mark.parametrize("current", list(A))
@pytest.mark.parametrize("target", list(A))
def test_transition_table_is_enforced(current: AttemptState, target: AttemptState) -> None:
    allowed = target in ATTEMPT_TRANSITIONS[current]
    led = ledger()
    led._table.column("state")[led._slot(7), 0] = int(current)
    moves: dict[AttemptState, Callable[[], object]] = {
        A.RESERVED: lambda: led.refuse(7, 0) if current == A.DISPATCHED else led.retry(7, 0),
        A.DISPATCHED: lambda: led.dispatch(7, 0),
        A.SEALED: lambda: led._move(7, 0, A.SEALED, "seal"),
        A.FAILED: lambda: led.fail(7, 0),
        A.ABANDONED: lambda: led.abandon(7, 0),
    }
    move = moves[target]
    if allowed:
        move()
        assert led.state(7, 0) == target
    else:
        with pytest.raises(IllegalTransition) as info:
            move()
        assert info.value.current == current.name and info.value.target == target.name
        assert "run-7_g0" in str(info.value)
        assert led.state(7, 0) == current


def test_unknown_group_and_sibling_are_named() -> None:
    led = ledger()
    with pytest.raises(UnknownGroup, match="group 8"):
        led.dispatch(8, 0)
    with pytest.raises(InvalidInput, match="sibling 2"):
        led.dispatch(7, 2)
    with pytest.raises(LedgerInvariantViolation, match="already owned"):
        led.reserve_group(7, RestoreLevel.SIBLING)


def _half_done(
    level: RestoreLevel, restored: dict[int, str] | None = None
) -> tuple[Ledger, RestartOutcome]:
    led = ledger(level, size=3)
    led.dispatch(7, 0, owner="env-1")
    led.seal(7, 0, 0, digest("a"))
    led.dispatch(7, 1, owner="env-1")  # in flight at the snapshot
    return led, led.restart(7, restored)


def test_prompt_group_restart_abandons_every_sibling() -> None:
    led, outcome = _half_done(RestoreLevel.PROMPT_GROUP)
    assert outcome.kept == () and outcome.dropped_rows == (0,)
    assert outcome.regenerate == (0, 1, 2)
    assert [led.attempt(7, i) for i in range(3)] == [1, 1, 0]
    assert led.states(7) == [A.RESERVED] * 3
    assert {r.episode.key for r in led.retirements()} == {"run-7_g0", "run-7_g1"}


def test_sibling_restart_keeps_sealed_siblings() -> None:
    led, outcome = _half_done(RestoreLevel.SIBLING)
    assert outcome.kept == (0,) and outcome.regenerate == (1, 2) and outcome.resumed == ()
    assert led.state(7, 0) == A.SEALED and led.sealed_row_matches(7, 0, digest("a"))
    assert led.attempt(7, 1) == 1 and led.owner(7, 1) is None
    assert led.attempt(7, 2) == 0  # never dispatched: no attempt spent


@pytest.mark.parametrize("level", [RestoreLevel.TURN, RestoreLevel.PREFIX])
def test_turn_restart_keeps_the_attempt_on_its_instance(level: RestoreLevel) -> None:
    led, outcome = _half_done(level, restored={1: "env-1"})
    assert outcome.resumed == (1,) and outcome.kept == (0,) and outcome.regenerate == (2,)
    assert led.attempt(7, 1) == 1 and led.state(7, 1) == A.RESERVED
    assert led.owner(7, 1) == "env-1"
    with pytest.raises(LedgerInvariantViolation, match="must be dispatched there"):
        led.dispatch(7, 1, owner="env-2")
    assert led.dispatch(7, 1, owner="env-1").key == "run-7_g1-a1"


def test_turn_restart_without_an_environment_restore_falls_back_to_sibling() -> None:
    led, outcome = _half_done(RestoreLevel.TURN)
    assert outcome.resumed == () and outcome.regenerate == (1, 2)
    assert led.owner(7, 1) is None


def test_a_failed_environment_restore_restarts_the_sibling_past_its_retired_attempt() -> None:
    led = ledger(RestoreLevel.PREFIX, size=3)
    led.dispatch(7, 0, owner="env-1")
    led.seal(7, 0, 0, digest("a"))
    led.dispatch(7, 1, owner="env-1")  # committed by env-1, whose restore then failed
    outcome = led.restart(7, None, refused={1, 2})  # 2 was never dispatched: nothing to skip
    assert outcome.kept == (0,) and outcome.regenerate == (1, 2) and outcome.resumed == ()
    # Attempt 1 is retired on the environments: the rollout restarts as attempt 2.
    assert led.attempt(7, 1) == 2 and led.state(7, 1) == A.RESERVED and led.owner(7, 1) is None
    assert led.attempt(7, 2) == 0
    retired = {r.episode.key: r.owner for r in led.retirements()}
    assert retired == {"run-7_g1": "env-1", "run-7_g1-a1": None}  # None: everywhere
    assert led.dispatch(7, 1, owner="env-2").key == "run-7_g1-a2"


def test_a_restart_moves_an_episode_off_a_lost_instance_to_the_one_that_restored_it() -> None:
    led = ledger(RestoreLevel.TURN, size=3)
    led.dispatch(7, 1, owner="env-lost")
    outcome = led.restart(7, {1: "env-2"}, moved={1})
    assert outcome.resumed == (1,)
    assert led.owner(7, 1) == "env-2" and led.attempt(7, 1) == 1
    with pytest.raises(LedgerInvariantViolation, match="must be dispatched there"):
        led.dispatch(7, 1, owner="env-lost")
    assert led.dispatch(7, 1, owner="env-2").key == "run-7_g1-a1"


def test_turn_restart_refuses_a_different_instance() -> None:
    with pytest.raises(LedgerInvariantViolation, match="owned by 'env-1' but 'env-9'"):
        _half_done(RestoreLevel.TURN, restored={1: "env-9"})


def test_restored_episode_without_dispatched_attempt_is_an_error() -> None:
    with pytest.raises(LedgerInvariantViolation, match=r"siblings \[2\]"):
        _half_done(RestoreLevel.TURN, restored={2: "env-1"})


def test_restored_episodes_at_sibling_level_are_refused() -> None:
    with pytest.raises(LedgerInvariantViolation, match="level sibling"):
        _half_done(RestoreLevel.SIBLING, restored={1: "env-1"})


def test_capture_restore_round_trip() -> None:
    led = ledger(groups=(3, 9, 5), size=2)
    led.dispatch(9, 0, owner="env-a")
    led.seal(9, 0, 0, digest("x"))
    led.dispatch(5, 1, owner="env-b")
    led.abandon(5, 1)
    captured, meta = led.capture()
    with pytest.raises(SnapshotCorrupt, match="out of order"):  # rows as handed out: 3, 9, 5
        Ledger.restore(captured, meta, "test")
    arrays = in_key_order(captured)
    again = Ledger.restore(arrays, meta, "test")
    assert again.groups() == [3, 5, 9]
    assert again.sealed_row_matches(9, 0, digest("x")) and again.owner(9, 0) == "env-a"
    assert again.state(5, 1) == A.ABANDONED
    assert [r.episode.key for r in again.retirements()] == ["run-5_g1"]
    a2, m2 = again.capture()
    assert m2 == meta and all((a2[k] == arrays[k]).all() for k in arrays)


def test_a_capture_copies_nothing_and_keeps_its_bytes_through_every_later_write() -> None:
    led = ledger(groups=(3, 5, 9), size=2)
    led.dispatch(3, 0, owner="env-a")
    arrays, meta = led.capture()
    kept = {name: array.copy() for name, array in arrays.items()}
    # Shared, not copied: the park window does not pay for the ledger's size.
    assert np.shares_memory(arrays["digest"], led._table.live("digest"))
    with pytest.raises(ValueError, match="read-only"):
        arrays["state"][0, 0] = 0
    led.seal(3, 0, 0, digest("x"))  # state and digest columns
    led.dispatch(5, 1, owner="env-b")  # owner
    led.abandon(5, 1)
    led.retry(5, 1)  # attempt
    led.drop_group(3)  # moves the last row into the hole
    led.reserve_group(11, RestoreLevel.TURN)  # level, a new row
    for idx in range(12, 200):  # grows every buffer
        led.reserve_group(idx, RestoreLevel.PREFIX)
    assert all(np.array_equal(arrays[name], kept[name]) for name in kept)
    assert not np.shares_memory(arrays["digest"], led._table.live("digest"))
    restored = Ledger.restore(in_key_order(arrays), meta, "capture")
    assert restored.state(3, 0) == A.DISPATCHED and restored.digest(3, 0) is None
    assert led.groups()[:3] == [5, 9, 11] and led.attempt(5, 1) == 1


def test_restore_refuses_bad_metadata_and_states() -> None:
    led = ledger()
    arrays, meta = led.capture()
    with pytest.raises(SnapshotCorrupt, match="format_version"):
        Ledger.restore(arrays, {**meta, "format_version": "3"}, "f")
    with pytest.raises(SnapshotCorrupt, match=r"metadata unknown \['extra'\]"):
        Ledger.restore(arrays, {**meta, "extra": "1"}, "f")
    with pytest.raises(SnapshotCorrupt, match=r"not a rollsafe\.ledger file"):
        Ledger.restore(arrays, {**meta, "format": "rollsafe.replay_index"}, "f")
    bad = dict(arrays)
    bad["state"] = arrays["state"].copy()
    bad["state"][0, 0] = 9
    with pytest.raises(SnapshotCorrupt, match="unknown attempt state 9"):
        Ledger.restore(bad, meta, "f")
    with pytest.raises(SnapshotCorrupt, match="columns differ"):
        Ledger.restore({k: v for k, v in arrays.items() if k != "owner"}, meta, "f")


def test_drop_group_retires_in_flight_attempts() -> None:
    led = ledger()
    led.dispatch(7, 0, owner="env-0")
    led.drop_group(7)
    assert 7 not in led
    assert [r.episode.key for r in led.retirements()] == ["run-7_g0"]


def test_a_seal_digest_covers_every_field_of_the_entry_and_the_row() -> None:
    led = ledger(level=RestoreLevel.TURN)
    led.dispatch(7, 0, owner="env-a")
    led.seal(7, 0, 0, digest("row"))
    arrays, meta = led.capture()

    def restored_with(column: str, value: int) -> Ledger:
        changed = {name: array.copy() for name, array in arrays.items()}
        changed[column][(0,) if column == "level" else (0, 0)] = value  # group 7, sibling 0
        return Ledger.restore(changed, meta, "edited")

    assert Ledger.restore(arrays, meta, "as captured").sealed_row_matches(7, 0, digest("row"))
    for column, value in (("attempt", 1), ("owner", -1), ("level", int(RestoreLevel.PREFIX))):
        assert not restored_with(column, value).sealed_row_matches(7, 0, digest("row")), column


def test_an_earlier_rollsafes_ledger_of_row_digests_is_still_read() -> None:
    led = ledger()
    led.dispatch(7, 0)
    led.seal(7, 0, 0, digest("row"))
    arrays, meta = led.capture()
    legacy = {name: array.copy() for name, array in arrays.items()}
    legacy["digest"][0, 0] = np.frombuffer(digest("row"), dtype=np.uint8)
    old = Ledger.restore(legacy, {**meta, "format_version": "1"}, "v1")
    assert old.sealed_row_matches(7, 0, digest("row"))
    assert old.capture()[1]["format_version"] == "1"  # written back as it was read
