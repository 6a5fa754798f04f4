"""``rollsafe doctor``'s Temporal checks: the server answers, the namespace exists, rollsafe's
search attributes are registered with their types, and the server's clock agrees with ours.

The server is found exactly as ``rollsafe worker`` finds it
(``ConnectionSettings.from_environment``: ``TEMPORAL_*`` variables and the temporal CLI's
profiles), so a doctor that passes means a worker started from the same shell connects.
"""

from __future__ import annotations

import contextlib
import shlex
import time
import uuid
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict
from temporalio.api.enums.v1 import IndexedValueType, NamespaceState
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest, GetSystemInfoRequest
from temporalio.client import Client
from temporalio.common import SearchAttributeKey
from temporalio.service import RPCError, RPCStatusCode

from rollsafe.cli.doctor.checks import DoctorCheck, Status, failed, ok, skipped
from rollsafe.cli.exits import temporal_client_made
from rollsafe.errors import InvalidInput, RollsafeError, TemporalUnavailable
from rollsafe.temporal.connect import DEFAULT_NAMESPACE, ConnectionSettings, connect
from rollsafe.temporal.search_attributes import ALL

REACH = "Temporal reachable"
NAMESPACE = "namespace exists"
ATTRIBUTES = "search attributes"
CLOCK = "clock skew"
DEFAULT_MAX_SKEW_S = 2.0
# Answers that mean "this identity may not look", not "the deployment is broken".
_NOT_ALLOWED = (RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNIMPLEMENTED)
# The clock probe's workflow type: no worker has it and nobody polls its task queue, so it
# never runs; the execution timeout ends it even if the doctor dies before terminating it.
PROBE_WORKFLOW = "RollsafeDoctorClockProbe"
_PROBE_TIMEOUT = timedelta(minutes=1)
_now = time.time  # this machine's clock (a test moves it to fake a skew)

# The temporal CLI's spelling of each type (`--type` of `operator search-attribute create`).
CLI_TYPE_NAMES: Mapping[int, str] = {
    IndexedValueType.INDEXED_VALUE_TYPE_TEXT: "Text",
    IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD: "Keyword",
    IndexedValueType.INDEXED_VALUE_TYPE_INT: "Int",
    IndexedValueType.INDEXED_VALUE_TYPE_DOUBLE: "Double",
    IndexedValueType.INDEXED_VALUE_TYPE_BOOL: "Bool",
    IndexedValueType.INDEXED_VALUE_TYPE_DATETIME: "Datetime",
    IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD_LIST: "KeywordList",
}


# -- fix texts (pure) ------------------------------------------------------------------------


def cli_type_name(value: int) -> str:
    return CLI_TYPE_NAMES.get(value, f"unknown type {value}")


def _namespace_flag(namespace: str) -> str:
    # The temporal CLI defaults to "default"; any other namespace must be named.
    return "" if namespace == DEFAULT_NAMESPACE else f" --namespace {shlex.quote(namespace)}"


def create_attribute_command(name: str, type_name: str, namespace: str) -> str:
    flag = _namespace_flag(namespace)
    return f"temporal operator search-attribute create{flag} --name {name} --type {type_name}"


def remove_attribute_command(name: str, namespace: str) -> str:
    return f"temporal operator search-attribute remove{_namespace_flag(namespace)} --name {name}"


def namespace_create_command(namespace: str) -> str:
    return f"temporal operator namespace create --namespace {shlex.quote(namespace)}"


def attribute_findings(
    registered: Mapping[str, int], wanted: Iterable[SearchAttributeKey[Any]], namespace: str
) -> tuple[list[str], list[str]]:
    """``(problems, fix commands)`` for each wanted attribute missing from ``registered``
    (name -> IndexedValueType) or registered with another type."""
    problems: list[str] = []
    fixes: list[str] = []
    for key in wanted:
        need = cli_type_name(key.indexed_value_type)
        found = registered.get(key.name)
        if found is None:
            problems.append(f"{key.name} ({need}) is not registered")
            fixes.append(create_attribute_command(key.name, need, namespace))
        elif found != key.indexed_value_type:
            problems.append(
                f"{key.name} is registered as {cli_type_name(found)}, rollsafe needs {need}"
            )
            # A type cannot be changed in place: remove it, then create it again.
            fixes += [
                remove_attribute_command(key.name, namespace),
                create_attribute_command(key.name, need, namespace),
            ]
    return problems, fixes


# -- clock skew arithmetic (pure) ------------------------------------------------------------


class ClockSkew(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    offset_s: float  # server clock minus ours: positive when the server is ahead
    uncertainty_s: float  # half the round trip: when in it the server stamped is unknown


def measure_skew(server_s: float, sent_s: float, received_s: float) -> ClockSkew:
    """The server stamped ``server_s`` somewhere between our ``sent_s`` and ``received_s``
    (all Unix seconds): compare with the midpoint, which is off by at most half the trip."""
    if received_s < sent_s:
        raise ValueError(f"received {received_s} before sent {sent_s}")
    midpoint = (sent_s + received_s) / 2
    return ClockSkew(offset_s=server_s - midpoint, uncertainty_s=(received_s - sent_s) / 2)


def skew_too_large(skew: ClockSkew, max_skew_s: float) -> bool:
    """True only when the clocks differ by more than ``max_skew_s`` wherever in the round trip
    the server stamped: a slow round trip widens the window, it is not a skew."""
    return abs(skew.offset_s) - skew.uncertainty_s > max_skew_s


def describe_skew(skew: ClockSkew) -> str:
    direction = "ahead of" if skew.offset_s >= 0 else "behind"
    return (
        f"server clock {abs(skew.offset_s):.3f} s {direction} this machine's "
        f"(± {skew.uncertainty_s:.3f} s)"
    )


# -- the checks ------------------------------------------------------------------------------


async def temporal_checks(
    *, timeout_s: float, max_skew_s: float, settings: ConnectionSettings | None = None
) -> list[DoctorCheck]:
    """The four Temporal rows; each one after a failed one it needs is skipped."""
    later = (NAMESPACE, ATTRIBUTES, CLOCK)
    try:
        settings = settings or ConnectionSettings.from_environment()
    except InvalidInput as exc:
        fix = (
            "fix the Temporal client settings: TEMPORAL_ADDRESS=host:port, TEMPORAL_NAMESPACE, "
            "the TLS / API-key variables, or the TEMPORAL_PROFILE profile"
        )
        return [failed(REACH, str(exc), fix), *_skip(later, "no usable Temporal settings")]
    reach, client = await _reach(settings, timeout_s)
    if client is None:
        return [reach, *_skip(later, f"needs Temporal at {settings.address}")]
    rows = [reach, await _namespace(client, settings, timeout_s)]
    if rows[-1].status is Status.FAILED:
        return [*rows, *_skip(later[1:], f"needs namespace {settings.namespace!r}")]
    rows.append(await _attributes(client, settings.namespace, timeout_s))
    rows.append(await _clock(client, settings, timeout_s, max_skew_s))
    return rows


def _skip(names: Iterable[str], why: str) -> list[DoctorCheck]:
    return [skipped(name, why) for name in names]


async def _reach(
    settings: ConnectionSettings, timeout_s: float
) -> tuple[DoctorCheck, Client | None]:
    try:
        temporal_client_made()  # before: a failed connect has started the client's threads too
        client = await connect(settings, timeout_s=timeout_s, check_namespace=False)
        info = await client.workflow_service.get_system_info(
            GetSystemInfoRequest(), timeout=timedelta(seconds=timeout_s)
        )
    except InvalidInput as exc:  # refused credentials, unreadable TLS files
        fix = (
            "check the credentials: TEMPORAL_API_KEY, TEMPORAL_TLS_CLIENT_CERT_PATH / "
            "TEMPORAL_TLS_CLIENT_KEY_PATH, TEMPORAL_TLS_SERVER_CA_CERT_PATH (or the profile's)"
        )
        return failed(REACH, str(exc), fix), None
    except (RollsafeError, RPCError, TimeoutError) as exc:
        fix = (
            f"start the Temporal server at {settings.address} (locally: `rollsafe server`), or "
            "point TEMPORAL_ADDRESS (or the TEMPORAL_PROFILE profile) at the one that runs"
        )
        if isinstance(exc, TemporalUnavailable) and exc.fix:  # it answered: TLS differs
            fix = exc.fix
        return failed(REACH, str(exc), fix), None
    tls = "on" if settings.uses_tls else "off"
    version = info.server_version or "version not reported"
    return ok(REACH, f"{settings.address} answered (server {version}, TLS {tls})"), client


async def _namespace(client: Client, settings: ConnectionSettings, timeout_s: float) -> DoctorCheck:
    namespace = settings.namespace
    try:
        described = await client.workflow_service.describe_namespace(
            DescribeNamespaceRequest(namespace=namespace), timeout=timedelta(seconds=timeout_s)
        )
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            detail = f"namespace {namespace!r} does not exist on {settings.address}"
            fix = f"{namespace_create_command(namespace)} (or use an existing TEMPORAL_NAMESPACE)"
            return failed(NAMESPACE, detail, fix)
        if exc.status in _NOT_ALLOWED:
            return skipped(NAMESPACE, f"not allowed to describe {namespace!r}: {exc.message}")
        return failed(NAMESPACE, _rpc_error("describe_namespace", exc), "see the server's log")
    state = NamespaceState.Name(described.namespace_info.state).removeprefix("NAMESPACE_STATE_")
    if described.namespace_info.state != NamespaceState.NAMESPACE_STATE_REGISTERED:
        fix = "set TEMPORAL_NAMESPACE to a registered namespace"
        return failed(NAMESPACE, f"namespace {namespace!r} is {state.lower()}", fix)
    retention = described.config.workflow_execution_retention_ttl.ToTimedelta()
    return ok(NAMESPACE, f"{namespace!r} registered, retention {_hours(retention)}")


def _hours(span: timedelta) -> str:
    hours = span.total_seconds() / 3600
    if hours < 24:
        return f"{hours:g} h"
    return f"{hours / 24:g} day" + ("" if hours == 24 else "s")


def _rpc_error(call: str, exc: RPCError) -> str:
    return f"{call} failed: {exc.status.name} {exc.message}"


async def _attributes(client: Client, namespace: str, timeout_s: float) -> DoctorCheck:
    try:
        listed = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=namespace), timeout=timedelta(seconds=timeout_s)
        )
    except RPCError as exc:
        if exc.status in _NOT_ALLOWED:
            why = f"not allowed to list search attributes: {exc.message}"
            return skipped(ATTRIBUTES, why, "check with `temporal operator search-attribute list`")
        return failed(ATTRIBUTES, _rpc_error("list_search_attributes", exc), "see the server's log")
    problems, fixes = attribute_findings(dict(listed.custom_attributes), ALL, namespace)
    if problems:
        return failed(ATTRIBUTES, "; ".join(problems), "; ".join(fixes))
    names = ", ".join(f"{key.name} ({cli_type_name(key.indexed_value_type)})" for key in ALL)
    return ok(ATTRIBUTES, names)


async def _clock(
    client: Client, settings: ConnectionSettings, timeout_s: float, max_skew_s: float
) -> DoctorCheck:
    try:
        skew = await server_clock_skew(client, timeout_s)
    except (RPCError, TimeoutError) as exc:
        if isinstance(exc, RPCError) and exc.status in _NOT_ALLOWED:
            return skipped(CLOCK, f"not allowed to start the probe workflow: {exc.message}")
        why = _rpc_error("the probe workflow", exc) if isinstance(exc, RPCError) else "timed out"
        return failed(CLOCK, f"could not read the server's clock: {why}", "see the server's log")
    detail = f"{describe_skew(skew)}; limit {max_skew_s:g} s"
    if skew_too_large(skew, max_skew_s):
        fix = (
            f"synchronise this machine's clock and that of the Temporal server at "
            f"{settings.address} with NTP (`timedatectl`, `chronyc tracking`): environment "
            "leases and checkpoint deadlines are absolute times compared across machines"
        )
        return failed(CLOCK, detail, fix)
    return ok(CLOCK, detail)


async def server_clock_skew(client: Client, timeout_s: float) -> ClockSkew:
    """Start a workflow nobody will run and read the server's stamp on its first history event
    (WorkflowExecutionStarted: the server's clock when it took the start), then terminate it.
    The only server clock reading the API offers without a worker."""
    rpc_timeout = timedelta(seconds=timeout_s)
    token = uuid.uuid4().hex
    sent = _now()
    handle = await client.start_workflow(
        PROBE_WORKFLOW,
        id=f"rollsafe-doctor/clock/{token}",
        task_queue=f"rollsafe-doctor.{token}",  # a queue of its own: no worker ever polls it
        execution_timeout=_PROBE_TIMEOUT,
        rpc_timeout=rpc_timeout,
    )
    received = _now()
    try:
        async for event in handle.fetch_history_events(page_size=1, rpc_timeout=rpc_timeout):
            stamp = event.event_time.seconds + event.event_time.nanos / 1e9
            return measure_skew(stamp, sent, received)
        raise RPCError("the probe workflow has no history", RPCStatusCode.NOT_FOUND, b"")
    finally:
        # Already ended, or the server went away: the execution timeout ends it then.
        with contextlib.suppress(RPCError):
            await handle.terminate(reason="rollsafe doctor clock probe", rpc_timeout=rpc_timeout)
