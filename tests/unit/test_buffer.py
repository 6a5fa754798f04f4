import pytest

from rollsafe.core.buffer import ReplayIndex, SamplerState, make_sampler
from rollsafe.core.columns import in_key_order
from rollsafe.core.states import GroupState as G
from rollsafe.errors import IllegalTransition, InvalidInput, SnapshotCorrupt, UnknownGroup


def index_with(groups: dict[int, tuple[G, int]], size: int = 2) -> ReplayIndex:
    """groups: idx -> (state, start version); builds them through real transitions."""
    index = ReplayIndex(size)
    for idx, (state, version) in sorted(groups.items()):
        index.reserve(idx, version)
        if state != G.RESERVED:
            index.start(idx, version)
        if state in (G.READY, G.CLAIMED):
            index.set_sealed(idx, size)
        if state == G.CLAIMED:
            index.claim([idx], step=0)
    return index


def test_group_lifecycle() -> None:
    index = ReplayIndex(2)
    index.reserve(4, weight_version=0)
    assert index.state(4) == G.RESERVED
    index.start(4, weight_version=3)  # stamped when generation starts
    assert index.state(4) == G.GENERATING and index.start_version(4) == 3
    index.start(4, weight_version=5)  # only the first dispatch stamps
    assert index.start_version(4) == 3
    index.set_sealed(4, 1)
    assert index.state(4) == G.GENERATING
    index.set_sealed(4, 2)
    assert index.state(4) == G.READY
    index.claim([4], step=7)
    assert index.state(4) == G.CLAIMED and index.claim_step(4) == 7
    assert index.release_claims() == [4]
    assert index.state(4) == G.READY and index.claim_step(4) is None
    index.train([4])
    assert 4 not in index and index.trained_total == 1
    with pytest.raises(UnknownGroup, match="group 4"):
        index.train([4])


def test_train_needs_ready_or_claimed_and_is_all_or_nothing() -> None:
    index = index_with({1: (G.READY, 0), 2: (G.GENERATING, 0)})
    with pytest.raises(IllegalTransition, match="group 2: illegal transition GENERATING -> TRAIN"):
        index.train([1, 2])
    assert index.state(1) == G.READY


def test_claim_is_all_or_nothing() -> None:
    index = index_with({1: (G.READY, 0), 2: (G.RESERVED, 0)})
    with pytest.raises(IllegalTransition):
        index.claim([1, 2], step=0)
    assert index.state(1) == G.READY


def test_evict_removes_but_not_a_claimed_group() -> None:
    index = index_with({1: (G.GENERATING, 0), 2: (G.CLAIMED, 0)})
    index.evict(1)
    assert 1 not in index and index.evicted_total == 1
    with pytest.raises(IllegalTransition):
        index.evict(2)


def test_capture_restore_round_trip_and_validation() -> None:
    index = index_with({3: (G.READY, 1), 5: (G.CLAIMED, 0), 8: (G.RESERVED, 2)})
    index.train([3])
    captured, meta = index.capture()
    arrays = in_key_order(captured)  # group 3 left: its hole holds the last row
    again = ReplayIndex.restore(arrays, meta, "t")
    assert again.rows() == index.rows() and again.trained_total == 1
    assert again.claim_step(5) == 0
    bad = {**arrays, "sealed": arrays["sealed"].copy()}
    bad["sealed"][0] = 1  # a claimed group with one sealed rollout
    with pytest.raises(SnapshotCorrupt, match="sealed counts"):
        ReplayIndex.restore(bad, meta, "t")
    with pytest.raises(SnapshotCorrupt, match="format_version"):
        ReplayIndex.restore(arrays, {**meta, "format_version": "9"}, "t")


READY_MIX = {
    9: (G.READY, 0),  # lag 3 at version 3
    10: (G.READY, 2),
    11: (G.GENERATING, 1),
    12: (G.READY, 3),
    13: (G.READY, 2),
}


@pytest.mark.parametrize(
    ("name", "window", "count", "expected"),
    [
        ("windowed", 1, 2, [10, 12]),  # 9 too stale, 11 not ready
        ("windowed", 1, 3, [10, 12, 13]),
        ("windowed", 3, 2, [9, 10]),
        ("windowed", 1, 4, []),  # never a short step
        ("in_order", 1, 2, [9, 10]),
        ("in_order", 1, 3, []),  # 11 is next in dataset order and still generating
        ("weight_fifo", 1, 1, [9]),
        ("weight_fifo", 1, 2, []),  # 11 (version 1) is next by weight and not ready
    ],
)
def test_sampler_selection(name: str, window: int, count: int, expected: list[int]) -> None:
    sampler = make_sampler(name, staleness_window=window)
    assert sampler.select(index_with(READY_MIX), weight_version=3, count=count) == expected


def test_weight_fifo_orders_by_start_version_then_index() -> None:
    index = index_with({1: (G.READY, 4), 2: (G.READY, 1), 3: (G.READY, 1)})
    assert make_sampler("weight_fifo").select(index, 4, 3) == [2, 3, 1]


def test_gated_samplers_skip_claimed_groups() -> None:
    index = index_with({1: (G.CLAIMED, 0), 2: (G.READY, 0), 3: (G.READY, 0)})
    assert make_sampler("in_order").select(index, 0, 2) == [2, 3]
    assert make_sampler("weight_fifo").select(index, 0, 2) == [2, 3]


def test_sampler_state_round_trip_and_mismatch() -> None:
    index = index_with({4: (G.READY, 0), 6: (G.READY, 0)})
    sampler = make_sampler("in_order")
    index.train([4])
    sampler.committed(index, [4])
    state = sampler.state()
    assert state.cursor == 6 and state.steps_committed == 1 and state.groups_committed == 1
    fresh = make_sampler("in_order")
    fresh.load_state(SamplerState.model_validate_json(state.model_dump_json()), index)
    assert fresh.state() == state
    with pytest.raises(InvalidInput, match="taken with sampler 'in_order'"):
        make_sampler("windowed").load_state(state, index)
    behind = index_with({2: (G.READY, 0)})
    with pytest.raises(SnapshotCorrupt, match="cursor 6 is past owned group 2"):
        make_sampler("in_order").load_state(state, behind)


def test_sampler_state_refuses_unknown_fields() -> None:
    with pytest.raises(ValueError, match="extra"):
        SamplerState.model_validate({"name": "windowed", "surprise": 1})


def test_unknown_sampler_is_named() -> None:
    with pytest.raises(InvalidInput, match="unknown sampler 'lifo'"):
        make_sampler("lifo")
