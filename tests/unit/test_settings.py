"""rollsafe.Settings: one model, loaded from a mapping, the environment and a YAML file, in that
order of precedence; unknown keys refused by name; each value's source reported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from pydantic import ValidationError

from rollsafe.core.config import KEEP_LATEST_K, RunConfig
from rollsafe.errors import InvalidInput
from rollsafe.settings import Settings
from rollsafe.workflows.models import PhaseOptions, SupervisorConfig

NEMO_STYLE = """\
policy:
  model_name: tiny
checkpointing:
  enabled: true
  save_period: 10
rollsafe:
  run_id: grpo-7
  snapshot_root: /shared/rollsafe
  run:
    group_size: 8
    groups_per_step: 32
  snapshots:
    interval_s: 600
"""


def test_defaults_are_the_models_own() -> None:
    settings = Settings.load(env={})
    assert settings.snapshots.keep_latest_k == KEEP_LATEST_K
    assert settings.snapshots.interval_s == SupervisorConfig.model_fields["interval_s"].default
    assert settings.run.sampler == RunConfig.model_fields["sampler"].default
    assert settings.phases == PhaseOptions()
    assert set(settings.origins().values()) == {"default"}


def test_a_frameworks_config_file_is_read_from_its_rollsafe_section(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(NEMO_STYLE)
    settings = Settings.load(file=path, env={})
    assert settings.run_config() == RunConfig(run_id="grpo-7", group_size=8, groups_per_step=32)
    assert settings.snapshots.interval_s == 600
    assert settings.origins()["run.group_size"] == f"file {path}"


def test_the_file_can_come_from_rollsafe_config(tmp_path: Path) -> None:
    path = tmp_path / "rollsafe.yaml"
    path.write_text("run_id: from-file\n")
    assert Settings.load(env={"ROLLSAFE_CONFIG": str(path)}).run_id == "from-file"


def test_mapping_over_environment_over_file(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        "run_id: file\nsnapshots: {keep_latest_k: 5, interval_s: 30}\ndataplane: memory\n"
    )
    env = {"ROLLSAFE_RUN_ID": "env", "ROLLSAFE_SNAPSHOTS__KEEP_LATEST_K": "4"}
    settings = Settings.load({"run_id": "mapping"}, file=path, env=env)
    assert (settings.run_id, settings.snapshots.keep_latest_k) == ("mapping", 4)
    assert settings.snapshots.interval_s == 30  # the file's, untouched by the env's sibling key
    origins = settings.origins()
    assert origins["run_id"] == "mapping"
    assert origins["snapshots.keep_latest_k"] == "env ROLLSAFE_SNAPSHOTS__KEEP_LATEST_K"
    assert origins["snapshots.interval_s"] == f"file {path}"
    assert origins["snapshots.cache"] == "default"


def test_an_omegaconf_section_works_as_is() -> None:
    cfg = OmegaConf.create(
        {"rollsafe": {"run_id": "hydra", "run": {"group_size": 4, "groups_per_step": 2}}}
    )
    settings = Settings.load(cfg.rollsafe, env={})
    assert settings.run_config().group_size == 4


def test_ray_address_is_rays_own_variable() -> None:
    settings = Settings.load(env={"RAY_ADDRESS": "ray://head:10001"})
    assert settings.ray_address == "ray://head:10001"
    assert settings.origins()["ray_address"] == "env RAY_ADDRESS"


@pytest.mark.parametrize(
    ("mapping", "env", "named"),
    [
        ({"snapshots": {"intervl_s": 3}}, {}, "unknown key 'snapshots.intervl_s' (from mapping)"),
        ({"journl": True}, {}, "unknown key 'journl'"),
        (
            None,
            {"ROLLSAFE_PHASES__RETRIES": "3"},
            "unknown key 'phases.retries' (from env ROLLSAFE_PHASES__RETRIES)",
        ),
        ({"run": {"group_size": 0}}, {}, "run.group_size: Input should be greater"),
        ({"run_id": "bad id!"}, {}, "run_id"),
        ({"telemetry": {"log_format": "xml"}}, {}, "telemetry.log_format"),
    ],
)
def test_bad_or_unknown_keys_are_refused_by_name(
    mapping: dict[str, object] | None, env: dict[str, str], named: str
) -> None:
    with pytest.raises(InvalidInput, match="settings: ") as caught:
        Settings.load(mapping, env=env)
    assert named in str(caught.value)


def test_a_malformed_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("run_id: [unclosed\n")
    with pytest.raises(InvalidInput, match=r"bad\.yaml is not YAML"):
        Settings.load(file=path, env={})
    path.write_text("- a list\n")
    with pytest.raises(InvalidInput, match="expected a mapping"):
        Settings.load(file=path, env={})
    with pytest.raises(InvalidInput, match=r"missing\.yaml"):
        Settings.load(file=tmp_path / "missing.yaml", env={})


def test_run_config_names_what_is_missing() -> None:
    with pytest.raises(InvalidInput, match="no run id: set ROLLSAFE_RUN_ID"):
        Settings.load(env={}).run_config()
    with pytest.raises(InvalidInput, match="ROLLSAFE_RUN__GROUPS_PER_STEP"):
        Settings.load({"run_id": "r"}, env={}).run_config(group_size=2)


@pytest.mark.parametrize(
    ("participants", "level", "why"),
    [
        ({}, RunConfig.model_fields["restore_level"].default, "no participants"),
        ({"envs": {"w0": "http://h:1"}}, "turn", "participants.envs is set, no engine"),
        ({"envs": {"w0": "http://h:1"}, "engines": {"e0": "http://h:2"}}, "prefix", "engines"),
    ],
)
def test_the_default_restore_level_is_the_most_lossless_the_participants_support(
    participants: dict[str, Any], level: str, why: str
) -> None:
    settings = Settings.load({"run_id": "r", "participants": participants}, env={})
    assert settings.run_config(group_size=2, groups_per_step=1).restore_level == level
    (row,) = [r for r in settings.effective(env={}) if r.key == "run.restore_level"]
    assert row.value == level and row.source.startswith("default: ") and why in row.source
    # Set, it is what it is, wherever it came from.
    chosen = Settings.load(
        {"run_id": "r", "participants": participants},
        env={"ROLLSAFE_RUN__RESTORE_LEVEL": "sibling"},
    )
    assert chosen.run_config(group_size=2, groups_per_step=1).restore_level == "sibling"
    (row,) = [r for r in chosen.effective(env={}) if r.key == "run.restore_level"]
    assert (row.value, row.source) == ("sibling", "env ROLLSAFE_RUN__RESTORE_LEVEL")


def test_supervisor_config_takes_the_sections_and_keyword_overrides() -> None:
    settings = Settings.load(
        {"run_id": "r", "snapshots": {"interval_s": 60}, "phases": {"retry_attempts": 9}},
        env={},
    )
    config = settings.supervisor_config(max_consecutive_failures=7)
    assert (config.interval_s, config.max_consecutive_failures) == (60, 7)
    assert config.options.retry_attempts == 9


def test_temporal_connection_is_temporals_config_with_the_section_on_top() -> None:
    env = {"TEMPORAL_ADDRESS": "temporal.example:7233", "TEMPORAL_NAMESPACE": "prod"}
    settings = Settings.load({"temporal": {"namespace": "staging"}}, env=env)
    connection = settings.connection(env=env)
    assert (connection.address, connection.namespace) == ("temporal.example:7233", "staging")
    rows = {row.key: row for row in settings.effective(env=env)}
    assert rows["temporal.address"].source == "env TEMPORAL_ADDRESS"
    assert rows["temporal.namespace"].source == "mapping"


def test_effective_masks_secrets() -> None:
    settings = Settings.load({"temporal": {"api_key": "sekrit"}}, env={})
    rows = {row.key: row for row in settings.effective(env={})}
    assert rows["temporal.api_key"].value == "**********"
    assert "sekrit" not in repr(settings) and "sekrit" not in str(settings.effective(env={}))


def test_a_mapping_value_is_replaced_whole_by_a_higher_layer(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("participants:\n  envs: {a: 'http://a:1', b: 'http://b:1'}\n")
    from_file = Settings.load(file=path, env={})
    assert from_file.origins()["participants.envs"] == f"file {path}"
    env = {"ROLLSAFE_PARTICIPANTS__ENVS": '{"c": "http://c:1"}'}
    settings = Settings.load(file=path, env=env)
    assert settings.participants.envs == {"c": "http://c:1"}  # not merged with the file's
    assert settings.origins()["participants.envs"] == "env ROLLSAFE_PARTICIPANTS__ENVS"


def test_effective_shows_the_participants_tokens_masked_with_their_source(tmp_path: Path) -> None:
    token = tmp_path / "engine.token"
    settings = Settings.load({"participants": {"engine_token_file": str(token)}}, env={})
    rows = {row.key: row for row in settings.effective(env={"ROLLSAFE_ENV_TOKEN": "sekrit"})}
    assert (rows["participants.env_token"].value, rows["participants.env_token"].source) == (
        "**********",
        "env ROLLSAFE_ENV_TOKEN",
    )
    assert rows["participants.engine_token"].source == f"file {token}"
    unset = {row.key: row for row in Settings.load(env={}).effective(env={})}
    assert unset["participants.env_token"].source == "not set"


@pytest.mark.parametrize("field", ["heartbeat_timeout_s", "task_timeout_s"])
def test_the_admission_lease_must_outlast_a_takeover(field: str) -> None:
    """A dead worker's phase is handed on after the heartbeat timeout (regular activities) or
    the task timeout (the park window's local activities): a shorter lease reopens first."""
    with pytest.raises(ValidationError, match=f"admission_lease_s \\(5\\) must exceed {field}"):
        PhaseOptions(
            **{"heartbeat_timeout_s": 1, "task_timeout_s": 1, field: 5}, admission_lease_s=5
        )
    assert PhaseOptions(admission_lease_s=5.5, heartbeat_timeout_s=5, task_timeout_s=5)


def test_the_constructor_resolves_as_load_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Settings(...)`` and ``Settings.load(...)``: the same sources in the same order
    (keywords or mapping, then the environment, then ROLLSAFE_CONFIG's file)."""
    path = tmp_path / "train.yaml"
    path.write_text(NEMO_STYLE)
    monkeypatch.setenv("ROLLSAFE_CONFIG", str(path))
    monkeypatch.setenv("ROLLSAFE_SNAPSHOTS__INTERVAL_S", "30")
    built = Settings(run_id="from-mapping")
    loaded = Settings.load({"run_id": "from-mapping"})
    assert built.model_dump() == loaded.model_dump()  # (load also records the origins)
    assert (built.run_id, built.snapshots.interval_s, built.run.group_size) == (
        "from-mapping",
        30,
        8,
    )
