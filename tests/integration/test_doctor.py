"""`rollsafe doctor` against real Temporal dev servers: a healthy one passes; a missing or
wrongly typed search attribute, an unknown namespace and a skewed clock are named with their fix.

The tests are synchronous because the command runs its own event loop; each async step gets
its own ``asyncio.run`` (and its own client: a client belongs to the loop it connected in).
Every server a test starts is stopped by the test (``finally``), even when it fails.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import (
    AddSearchAttributesRequest,
    RemoveSearchAttributesRequest,
)
from temporalio.client import WorkflowExecutionStatus
from typer.testing import CliRunner

from rollsafe.cli.app import app
from rollsafe.cli.doctor import DoctorReport
from rollsafe.cli.doctor import temporal as doctor_temporal
from rollsafe.cli.doctor.checks import DoctorCheck, Status
from rollsafe.cli.doctor.temporal import PROBE_WORKFLOW
from rollsafe.temporal.connect import ConnectionSettings, connect
from rollsafe.temporal.devserver import DevServer

TEMPORAL_ROWS = ("Temporal reachable", "namespace exists", "search attributes", "clock skew")


def doctor(server: Any, *args: str, namespace: str | None = None) -> tuple[int, str]:
    env = {
        "TEMPORAL_ADDRESS": server.address,
        "TEMPORAL_NAMESPACE": namespace or server.namespace,
        "TEMPORAL_CONFIG_FILE": "/nonexistent/temporal.toml",  # no user profile leaks in
        "TEMPORAL_PROFILE": None,
        "RAY_ADDRESS": None,
        "ROLLSAFE_SNAPSHOT_ROOT": None,
    }
    result = CliRunner().invoke(app, ["doctor", *args], env=env)
    return result.exit_code, result.output


def doctor_json(server: Any, *args: str, namespace: str | None = None) -> dict[str, DoctorCheck]:
    _code, output = doctor(server, "--json", *args, namespace=namespace)
    return {check.name: check for check in DoctorReport.model_validate_json(output).checks}


async def probe_statuses(settings: ConnectionSettings) -> list[WorkflowExecutionStatus | None]:
    client = await connect(settings)
    query = f"WorkflowType = '{PROBE_WORKFLOW}'"
    return [execution.status async for execution in client.list_workflows(query)]


def test_a_healthy_deployment_passes(server: Any, tmp_path: Path) -> None:
    code, output = doctor(server, "--snapshot-root", str(tmp_path / "snapshots"))
    assert code == 0, output
    for name in (*TEMPORAL_ROWS, "snapshot storage"):
        assert f"│ {name}" in output
    assert "FAILED" not in output and "skipped" in output  # Ray: no address given

    found = doctor_json(server, "--snapshot-root", str(tmp_path))
    assert all(found[name].status is Status.OK for name in TEMPORAL_ROWS), found
    assert found["Ray reachable"].status is Status.SKIPPED
    assert server.address in found["Temporal reachable"].detail
    assert "limit 2 s" in found["clock skew"].detail
    assert os.listdir(tmp_path) == []  # the storage probe cleaned up

    # The clock probes never ran (nobody polls their queue) and were ended, not left open.
    statuses = asyncio.run(probe_statuses(server.settings()))
    assert len(statuses) >= 2
    assert set(statuses) == {WorkflowExecutionStatus.TERMINATED}


def test_an_unknown_namespace_is_named_with_the_create_command(server: Any) -> None:
    code, _ = doctor(server, namespace="no-such-namespace")
    assert code == 1
    found = doctor_json(server, namespace="no-such-namespace")
    namespace = found["namespace exists"]
    assert namespace.status is Status.FAILED
    assert "'no-such-namespace' does not exist" in namespace.detail
    assert "temporal operator namespace create --namespace no-such-namespace" in namespace.fix
    assert found["search attributes"].status is Status.SKIPPED
    assert found["clock skew"].status is Status.SKIPPED


@pytest.mark.parametrize(("shift_s", "word"), [(10.0, "behind"), (-10.0, "ahead of")])
def test_a_skewed_clock_is_named_with_the_ntp_fix(
    server: Any, monkeypatch: pytest.MonkeyPatch, shift_s: float, word: str
) -> None:
    # Moving this machine's clock by 10 s makes the server's look 10 s off the other way.
    monkeypatch.setattr(doctor_temporal, "_now", lambda: time.time() + shift_s)
    code, _ = doctor(server)
    assert code == 1
    clock = doctor_json(server)["clock skew"]
    assert clock.status is Status.FAILED
    measured = re.match(rf"server clock ([0-9.]+) s {word} this machine's", clock.detail)
    assert measured is not None, clock.detail
    assert float(measured[1]) == pytest.approx(10.0, abs=0.5)
    assert "NTP" in clock.fix and server.address in clock.fix


async def _change_attributes(
    settings: ConnectionSettings, *, remove: str = "", text: str = ""
) -> None:
    client = await connect(settings)
    if remove:
        await client.operator_service.remove_search_attributes(
            RemoveSearchAttributesRequest(namespace=settings.namespace, search_attributes=[remove])
        )
    if text:
        wanted = {text: IndexedValueType.INDEXED_VALUE_TYPE_TEXT}
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=settings.namespace, search_attributes=wanted)
        )


def test_a_missing_then_mistyped_search_attribute_is_named(tmp_path: Path) -> None:
    # A server of its own: the session's server must keep all three attributes.
    dev = DevServer(tmp_path / "temporal")
    try:
        asyncio.run(dev.start())
        asyncio.run(_change_attributes(dev.settings(), remove="RollsafeKind"))
        code, output = doctor(dev)
        assert code == 1
        assert "RollsafeKind (Keyword) is not registered" in " ".join(output.split())
        missing = doctor_json(dev)["search attributes"]
        assert missing.status is Status.FAILED
        assert missing.detail == "RollsafeKind (Keyword) is not registered"
        assert missing.fix == (
            "temporal operator search-attribute create --name RollsafeKind --type Keyword"
        )

        asyncio.run(_change_attributes(dev.settings(), text="RollsafeKind"))
        mistyped = doctor_json(dev)["search attributes"]
        assert mistyped.status is Status.FAILED
        assert mistyped.detail == "RollsafeKind is registered as Text, rollsafe needs Keyword"
        assert mistyped.fix == (
            "temporal operator search-attribute remove --name RollsafeKind; "
            "temporal operator search-attribute create --name RollsafeKind --type Keyword"
        )
    finally:
        dev.stop()
