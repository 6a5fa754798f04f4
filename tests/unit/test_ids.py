import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollsafe.core.ids import EpisodeId, GroupId, RolloutId, validate_run_id
from rollsafe.errors import InvalidInput

run_ids = st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True)


def test_wire_keys_follow_design() -> None:
    group = GroupId("run-1", 12)
    rollout = group.rollout(3)
    assert group.key == "run-1-12"
    assert rollout.key == "run-1-12_g3"
    assert rollout.episode(0).key == "run-1-12_g3"
    assert rollout.episode(2).key == "run-1-12_g3-a2"


@given(run=run_ids, idx=st.integers(0, 10**9), i=st.integers(0, 1023), attempt=st.integers(0, 999))
def test_episode_keys_round_trip(run: str, idx: int, i: int, attempt: int) -> None:
    episode = GroupId(run, idx).rollout(i).episode(attempt)
    assert EpisodeId.parse(episode.key) == episode
    assert RolloutId.parse(episode.rollout.key) == episode.rollout


@given(
    run=run_ids,
    a=st.tuples(st.integers(0, 50), st.integers(0, 5), st.integers(0, 5)),
    b=st.tuples(st.integers(0, 50), st.integers(0, 5), st.integers(0, 5)),
)
def test_episode_keys_are_injective(
    run: str, a: tuple[int, int, int], b: tuple[int, int, int]
) -> None:
    ka = GroupId(run, a[0]).rollout(a[1]).episode(a[2]).key
    kb = GroupId(run, b[0]).rollout(b[1]).episode(b[2]).key
    assert (ka == kb) == (a == b)


@pytest.mark.parametrize("bad", ["", "a b", "x" * 65, "run/1", "ü"])
def test_run_id_validation_names_the_value(bad: str) -> None:
    with pytest.raises(InvalidInput, match="invalid run id"):
        validate_run_id(bad)


@pytest.mark.parametrize("bad", ["run-1-12", "run-1-12_g", "run-1-012_g1", "run-1-1_g1-a0", "_g1"])
def test_malformed_episode_keys_are_refused(bad: str) -> None:
    with pytest.raises(InvalidInput):
        EpisodeId.parse(bad)


def test_negative_numbers_are_refused() -> None:
    with pytest.raises(InvalidInput, match="dataset index"):
        GroupId("r", -1)
    with pytest.raises(InvalidInput, match="attempt"):
        GroupId("r", 1).rollout(0).episode(-1)


def test_errors_survive_pickling_with_class_and_message() -> None:
    """Ray carries errors between processes by pickling them."""
    import pickle

    from rollsafe.errors import IllegalTransition, RollsafeError, RowMismatch

    for error in (
        IllegalTransition("rollout r", "seal", "RESERVED", "SEALED"),
        RowMismatch(3, 1, "k", "differs"),
    ):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
        assert isinstance(again, RollsafeError) and again.transient == error.transient
