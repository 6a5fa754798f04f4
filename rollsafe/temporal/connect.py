"""Where the Temporal server is, and a client that speaks rollsafe's payloads.

Settings follow Temporal's own client conventions (the same TOML profiles and ``TEMPORAL_*``
variables the ``temporal`` CLI reads), loaded by the SDK's ``temporalio.envconfig`` so the
precedence rules are Temporal's, not ours.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client
from temporalio.envconfig import ClientConfig, ClientConfigProfile, DataSource
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from rollsafe.errors import InvalidInput, TemporalUnavailable
from rollsafe.observability.metrics import temporal_runtime
from rollsafe.observability.tracing import client_plugins
from rollsafe.temporal.converter import data_converter
from rollsafe.temporal.diagnose import diagnose_connect_error

# 127.0.0.1 rather than the CLI's "localhost": localhost may resolve to ::1 first, where the
# dev server (bound to 127.0.0.1) does not listen.
DEFAULT_ADDRESS = "127.0.0.1:7233"
DEFAULT_NAMESPACE = "default"
DEFAULT_CONNECT_TIMEOUT_S = 10.0

# Temporal's own names (temporalio.envconfig): which profile of which TOML file.
PROFILE_ENV = "TEMPORAL_PROFILE"
CONFIG_FILE_ENV = "TEMPORAL_CONFIG_FILE"
DEFAULT_PROFILE = "default"
USER_CONFIG_FILE = "Temporal's per-user config file"
# The variable that sets each ConnectionSettings field, over the profile (grpc_meta: a prefix).
_VARIABLES = {
    "address": "TEMPORAL_ADDRESS",
    "namespace": "TEMPORAL_NAMESPACE",
    "api_key": "TEMPORAL_API_KEY",
    "tls": "TEMPORAL_TLS",
    "tls_server_ca_cert_path": "TEMPORAL_TLS_SERVER_CA_CERT_PATH",
    "tls_server_name": "TEMPORAL_TLS_SERVER_NAME",
    "tls_client_cert_path": "TEMPORAL_TLS_CLIENT_CERT_PATH",
    "tls_client_key_path": "TEMPORAL_TLS_CLIENT_KEY_PATH",
}
_GRPC_META_PREFIX = "TEMPORAL_GRPC_META_"

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
            where = _where(profile, config_file, env)
            raise InvalidInput(f"Temporal client config ({where}): {exc}") from exc
        try:
            return cls(**_fields_of(loaded))
        except ValidationError as exc:
            details = "; ".join(error["msg"] for error in exc.errors())
            raise InvalidInput(f"Temporal client config: {details}") from None


class ConfigSources(BaseModel):
    """Where Temporal's client config took each connection value from (``rollsafe config
    show``): the profile, and per field of :class:`ConnectionSettings` ``env NAME``,
    ``profile 'P' in FILE`` or ``default``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profile: str  # the profile read
    profile_source: str  # env TEMPORAL_PROFILE, default, or who gave it
    fields: dict[str, str]


def config_sources(
    profile: str | None = None,
    *,
    given_by: str = "argument",
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> ConfigSources:
    """Where :meth:`ConnectionSettings.from_environment` (same arguments) takes each value:
    a ``TEMPORAL_*`` variable over the profile's value in the TOML file over rollsafe's
    default. ``given_by`` names where an explicit ``profile`` came from. Reads the file, never
    prints its values (it may hold an API key)."""
    environ = os.environ if env is None else env
    if profile is not None:
        name, profile_source = profile, given_by
    elif environ.get(PROFILE_ENV):
        name, profile_source = environ[PROFILE_ENV], f"env {PROFILE_ENV}"
    else:
        name, profile_source = DEFAULT_PROFILE, "default"
    try:
        in_file = ClientConfig.load(config_source=config_file, override_env_vars=env)
    except (RuntimeError, OSError, TypeError) as exc:
        where = _where(profile, config_file, env)
        raise InvalidInput(f"Temporal client config ({where}): {exc}") from exc
    found = in_file.profiles.get(name)
    from_file = set(_fields_of(found)) if found is not None else set()
    file = _file_named(config_file, environ)
    fields = {}
    for field in ConnectionSettings.model_fields:
        variable = _VARIABLES.get(field)
        if variable is not None and variable in environ:
            fields[field] = f"env {variable}"
        elif field == "grpc_meta" and any(key.startswith(_GRPC_META_PREFIX) for key in environ):
            fields[field] = f"env {_GRPC_META_PREFIX}*"
        elif field in from_file:
            fields[field] = f"profile {name!r} in {file}"
        else:
            fields[field] = "default"
    return ConfigSources(profile=name, profile_source=profile_source, fields=fields)


def _fields_of(loaded: ClientConfigProfile) -> dict[str, Any]:
    """The :class:`ConnectionSettings` fields a loaded profile sets (only those it sets)."""
    fields: dict[str, Any] = {}
    if loaded.grpc_meta:
        fields["grpc_meta"] = dict(loaded.grpc_meta)
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
    return {name: value for name, value in fields.items() if value is not None}


def _file_named(config_file: Path | None, environ: Mapping[str, str]) -> str:
    if config_file is not None:
        return str(config_file)
    return environ.get(CONFIG_FILE_ENV) or USER_CONFIG_FILE


def _where(profile: str | None, config_file: Path | None, env: Mapping[str, str] | None) -> str:
    """Which profile of which file a load read, for its error."""
    environ = os.environ if env is None else env
    if profile is not None:
        named = f"profile {profile!r}"
    elif environ.get(PROFILE_ENV):
        named = f"profile {environ[PROFILE_ENV]!r} from {PROFILE_ENV}"
    else:
        named = f"profile {DEFAULT_PROFILE!r}"
    return f"{named}, file {_file_named(config_file, environ)}"


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
    may come back), or when its TLS does not match the settings (untrusted CA, server name,
    client certificate, TLS against plain text: its ``fix`` names the setting to change;
    rollsafe.temporal.diagnose), ``InvalidInput`` for unreadable TLS files, refused
    credentials or an unknown namespace. ``check_namespace=False`` skips the namespace check
    (``rollsafe doctor`` reports an unreachable server and a missing namespace as two findings).

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
                data_converter=data_converter,
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
        # The SDK reports transport failures (refused, DNS, TLS handshake) as RuntimeError:
        # its text says which, and so which setting to change.
        found = diagnose_connect_error(
            str(exc), tls=settings.uses_tls, client_cert=settings.tls_client_cert_path is not None
        )
        if not found.reached:  # nobody there: the caller's "start a server" fix
            raise TemporalUnavailable(f"cannot reach {where}: {found.cause}") from None
        raise TemporalUnavailable(
            f"cannot connect to {where}: {found.cause}", fix=found.fix
        ) from None
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
