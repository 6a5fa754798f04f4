"""Where the Temporal server is, and a client that speaks rollsafe's payloads.

Settings follow Temporal's own client conventions (the same TOML profiles and ``TEMPORAL_*``
variables the ``temporal`` CLI reads), loaded by the SDK's ``temporalio.envconfig`` so the
precedence rules are Temporal's, not ours.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.envconfig import ClientConfigProfile, DataSource
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from rollsafe.errors import InvalidInput, TemporalUnavailable
from rollsafe.observability.metrics import temporal_runtime
from rollsafe.observability.tracing import client_plugins

# 127.0.0.1 rather than the CLI's "localhost": localhost may resolve to ::1 first, where the
# dev server (bound to 127.0.0.1) does not listen.
DEFAULT_ADDRESS = "127.0.0.1:7233"
DEFAULT_NAMESPACE = "default"
DEFAULT_CONNECT_TIMEOUT_S = 10.0

# Credentials the server refuses will be refused again: retrying is pointless.
_REJECTED = (RPCStatusCode.UNAUTHENTICATED, RPCStatusCode.PERMISSION_DENIED)


class ConnectionSettings(BaseModel):
    """How to reach one namespace of one Temporal server."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str = DEFAULT_ADDRESS
    namespace: str = DEFAULT_NAMESPACE
    # None: TLS on exactly when a certificate, CA, server name or API key is configured
    # (Temporal's rule); True/False force it.
    tls: bool | None = None
    tls_server_ca_cert_path: Path | None = None
    tls_server_name: str | None = None
    tls_client_cert_path: Path | None = None
    tls_client_key_path: Path | None = None
    api_key: SecretStr | None = None
    grpc_meta: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> Self:
        host, sep, port = self.address.rpartition(":")
        # Without an explicit port the SDK silently dials port 80.
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"address {self.address!r} is not host:port")
        if not self.namespace:
            raise ValueError("namespace is empty")
        if (self.tls_client_cert_path is None) != (self.tls_client_key_path is None):
            raise ValueError("a TLS client certificate and its key go together: give both")
        return self

    @property
    def uses_tls(self) -> bool:
        if self.tls is not None:
            return self.tls
        return any(
            value is not None
            for value in (
                self.tls_server_ca_cert_path,
                self.tls_server_name,
                self.tls_client_cert_path,
                self.api_key,
            )
        )

    @classmethod
    def from_environment(
        cls,
        profile: str | None = None,
        *,
        config_file: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ConnectionSettings:
        """Settings from Temporal's client config: a TOML profile overlaid by ``TEMPORAL_*``.

        ``profile`` defaults to ``TEMPORAL_PROFILE``, then ``"default"``; the file to
        ``TEMPORAL_CONFIG_FILE``, then Temporal's per-user location (a missing file is no
        error). Variables: ``TEMPORAL_ADDRESS``, ``TEMPORAL_NAMESPACE``, ``TEMPORAL_API_KEY``,
        ``TEMPORAL_TLS``, ``TEMPORAL_TLS_CLIENT_CERT_PATH``, ``TEMPORAL_TLS_CLIENT_KEY_PATH``,
        ``TEMPORAL_TLS_SERVER_CA_CERT_PATH``, ``TEMPORAL_TLS_SERVER_NAME``,
        ``TEMPORAL_GRPC_META_*``. ``env`` replaces ``os.environ`` (tests).
        Raises ``InvalidInput`` for an unknown profile, an unreadable file or bad values.
        """
        try:
            loaded = ClientConfigProfile.load(
                profile=profile, config_source=config_file, override_env_vars=env
            )
        except (RuntimeError, OSError, TypeError) as exc:
            # The SDK's loader raises its bridge's ConfigError (a RuntimeError) for unknown
            # profiles and TOML errors.
            raise InvalidInput(f"Temporal client config: {exc}") from exc
        fields: dict[str, Any] = {"grpc_meta": dict(loaded.grpc_meta)}
        if loaded.address:
            fields["address"] = loaded.address
        if loaded.namespace:
            fields["namespace"] = loaded.namespace
        if loaded.api_key:
            fields["api_key"] = loaded.api_key
        if loaded.tls is not None:
            tls = loaded.tls
            if tls.disabled is not None:
                fields["tls"] = not tls.disabled
            fields["tls_server_name"] = tls.server_name
            fields["tls_server_ca_cert_path"] = _path_only(tls.server_root_ca_cert, "server CA")
            fields["tls_client_cert_path"] = _path_only(tls.client_cert, "client cert")
            fields["tls_client_key_path"] = _path_only(tls.client_private_key, "client key")
        try:
            return cls(**fields)
        except ValidationError as exc:
            details = "; ".join(error["msg"] for error in exc.errors())
            raise InvalidInput(f"Temporal client config: {details}") from None


def _path_only(source: DataSource | None, what: str) -> Path | None:
    # Settings hold paths only: inline PEM data would end up in reprs, logs and JSON dumps.
    if source is None or isinstance(source, Path):
        return source
    raise InvalidInput(
        f"Temporal client config: inline TLS {what} data is not supported; give a file path "
        "(e.g. TEMPORAL_TLS_CLIENT_CERT_PATH instead of TEMPORAL_TLS_CLIENT_CERT_DATA)"
    )


def _read(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read TLS {what} {path}: {exc.strerror or exc}") from None


def _tls_config(settings: ConnectionSettings) -> bool | TLSConfig:
    if not settings.uses_tls:
        return False
    return TLSConfig(
        domain=settings.tls_server_name,
        server_root_ca_cert=_read(settings.tls_server_ca_cert_path, "server CA"),
        client_cert=_read(settings.tls_client_cert_path, "client certificate"),
        client_private_key=_read(settings.tls_client_key_path, "client key"),
    )


async def connect(
    settings: ConnectionSettings | None = None,
    *,
    timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    check_namespace: bool = True,
) -> Client:
    """A client for ``settings`` (default: ``ConnectionSettings.from_environment()``) that
    always uses the pydantic data converter: every rollsafe workflow payload is a pydantic
    model, and a client with the default converter would turn them into plain dicts.

    Checks that the namespace exists. Raises ``TemporalUnavailable`` naming the address when the
    server cannot be reached or does not answer within ``timeout_s`` (a server that is down
    may come back), ``InvalidInput`` for unreadable TLS files, refused credentials or an
    unknown namespace. ``check_namespace=False`` skips the namespace check (``rollsafe
    doctor`` reports an unreachable server and a missing namespace as two findings).

    Telemetry follows the standard ``OTEL_*`` variables: spans through Temporal's tracing
    plugin (``OTEL_TRACES_EXPORTER``), and with ``OTEL_METRICS_EXPORTER=otlp`` the SDK's own
    metrics through one Temporal runtime per process, to the collector rollsafe's metrics go
    to (:func:`rollsafe.observability.metrics.temporal_runtime`; workers built from this
    client inherit it). A bad value there is an ``InvalidInput`` naming the variable.
    """
    if settings is None:
        settings = ConnectionSettings.from_environment()
    where = f"Temporal server at {settings.address} (namespace {settings.namespace!r})"
    plugins, runtime = client_plugins(), temporal_runtime()
    try:
        client = await asyncio.wait_for(
            Client.connect(
                settings.address,
                namespace=settings.namespace,
                api_key=settings.api_key.get_secret_value() if settings.api_key else None,
                tls=_tls_config(settings),
                rpc_metadata=settings.grpc_meta,
                data_converter=pydantic_data_converter,
                plugins=plugins,
                runtime=runtime,  # None: Temporal's default runtime
            ),
            timeout_s,
        )
        if check_namespace:
            await asyncio.wait_for(_check_namespace(client, settings.namespace), timeout_s)
    except TimeoutError:
        raise TemporalUnavailable(f"{where} did not answer within {timeout_s:g} s") from None
    except RPCError as exc:
        if exc.status in _REJECTED:
            raise InvalidInput(f"{where} refused the credentials: {exc.message}") from None
        raise TemporalUnavailable(f"{where} failed: {exc.status.name} {exc.message}") from None
    except RuntimeError as exc:
        # The SDK reports transport failures (refused, DNS, TLS handshake) as RuntimeError.
        raise TemporalUnavailable(f"cannot reach {where}: {exc}") from None
    return client


async def _check_namespace(client: Client, namespace: str) -> None:
    try:
        await client.workflow_service.describe_namespace(
            DescribeNamespaceRequest(namespace=namespace)
        )
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise InvalidInput(
                f"namespace {namespace!r} does not exist on the Temporal server at "
                f"{client.service_client.config.target_host}"
            ) from None
        # A namespace-scoped credential may not be allowed to describe it: the namespace is
        # then checked by the first real call instead.
        if exc.status != RPCStatusCode.PERMISSION_DENIED:
            raise
