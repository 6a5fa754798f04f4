"""`rollsafe config show` and Temporal's TOML profiles: the connection shown is the one a worker
connects with (``ConnectionSettings.from_environment``), the profile's name and where it was
chosen, and each value's source (a variable, the profile in its file, the default); secrets
from the profile stay masked."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from rollsafe.cli.app import app
from rollsafe.settings import Settings
from rollsafe.temporal.connect import ConnectionSettings

PROFILES = """\
[profile.default]
address = "default.example:7233"

[profile.staging]
address = "staging.example:7233"
namespace = "staging-ns"
api_key = "sekrit-key"

[profile.staging.tls]
client_cert_path = "/certs/c.pem"
client_key_path = "/certs/k.pem"
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "temporal.toml"
    path.write_text(PROFILES)
    return path


def clean_env(**given: str | None) -> dict[str, str | None]:
    """No TEMPORAL_* or ROLLSAFE_* variable of this machine leaks in; ``given`` on top."""
    unset: dict[str, str | None] = {
        name: None for name in os.environ if name.startswith(("TEMPORAL_", "ROLLSAFE_"))
    }
    return {**unset, **given}


def show(env: dict[str, str | None]) -> tuple[Any, dict[str, dict[str, Any]]]:
    result = CliRunner().invoke(app, ["config", "show", "--json"], env=env)
    rows = {row["key"]: row for row in json.loads(result.stdout)} if result.exit_code == 0 else {}
    return result, rows


def value_and_source(rows: dict[str, dict[str, Any]], key: str) -> tuple[Any, str]:
    return rows[f"temporal.{key}"]["value"], rows[f"temporal.{key}"]["source"]


def test_temporal_profile_selects_what_is_shown_as_the_worker_reads_it(config: Path) -> None:
    env = clean_env(TEMPORAL_CONFIG_FILE=str(config), TEMPORAL_PROFILE="staging")
    result, rows = show(env)
    assert result.exit_code == 0, result.output
    from_profile = f"profile 'staging' in {config}"
    assert value_and_source(rows, "profile") == ("staging", "env TEMPORAL_PROFILE")
    assert value_and_source(rows, "address") == ("staging.example:7233", from_profile)
    assert value_and_source(rows, "namespace") == ("staging-ns", from_profile)
    assert value_and_source(rows, "tls_client_cert_path") == ("/certs/c.pem", from_profile)
    assert value_and_source(rows, "api_key") == ("**********", from_profile)
    assert value_and_source(rows, "tls_server_name") == (None, "default")
    assert "sekrit" not in result.output

    # What a worker connects with, from the same environment.
    worker = ConnectionSettings.from_environment(
        env={key: value for key, value in env.items() if value is not None}
    )
    assert (worker.address, worker.namespace) == ("staging.example:7233", "staging-ns")


def test_a_variable_beats_the_profile_and_the_section_names_the_profile(config: Path) -> None:
    env = clean_env(
        TEMPORAL_CONFIG_FILE=str(config), TEMPORAL_PROFILE="staging", TEMPORAL_NAMESPACE="ovr"
    )
    _, rows = show(env)
    assert value_and_source(rows, "namespace") == ("ovr", "env TEMPORAL_NAMESPACE")
    assert value_and_source(rows, "address")[1] == f"profile 'staging' in {config}"

    # The settings' `temporal.profile` wins over TEMPORAL_PROFILE, as the connection uses it.
    section = {**env, "ROLLSAFE_TEMPORAL__PROFILE": "default"}
    result, rows = show(section)
    assert result.exit_code == 0, result.output
    assert value_and_source(rows, "profile") == ("default", "env ROLLSAFE_TEMPORAL__PROFILE")
    assert value_and_source(rows, "address") == (
        "default.example:7233",
        f"profile 'default' in {config}",
    )
    assert value_and_source(rows, "api_key") == (None, "default")


def test_without_a_profile_the_default_one_and_the_defaults_are_shown(tmp_path: Path) -> None:
    env = {"TEMPORAL_CONFIG_FILE": str(tmp_path / "absent.toml")}
    rows = {row.key: row for row in Settings.load(env=env).effective(env=env)}
    assert (rows["temporal.profile"].value, rows["temporal.profile"].source) == (
        "default",
        "default",
    )
    assert (rows["temporal.address"].value, rows["temporal.address"].source) == (
        ConnectionSettings().address,
        "default",
    )


def test_an_unknown_profile_is_refused_naming_it_and_the_file(config: Path) -> None:
    result, _ = show(clean_env(TEMPORAL_CONFIG_FILE=str(config), TEMPORAL_PROFILE="prod"))
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: Temporal client config (profile 'prod' from TEMPORAL_PROFILE")
    assert f"file {config}" in line and "Traceback" not in result.output
