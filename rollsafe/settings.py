"""One settings model for everything a user of rollsafe sets (docs/integrating.md, "Settings").

::

    settings = Settings.load()                          # environment (+ ROLLSAFE_CONFIG's file)
    settings = Settings.load(file="train.yaml")         # its `rollsafe:` section
    settings = Settings.load(cfg.rollsafe)              # an OmegaConf/Hydra section, a dict

Where a value comes from, the first that sets it wins:

1. the mapping given to :meth:`Settings.load` (a config section your training script holds);
2. environment variables: ``ROLLSAFE_<KEY>``, a section's keys joined with ``__``
   (``ROLLSAFE_SNAPSHOTS__INTERVAL_S=600``), and Ray's own ``RAY_ADDRESS``;
3. a YAML file (``file=`` or ``ROLLSAFE_CONFIG``): its ``rollsafe:`` section when it has one
   (a framework's whole config file), else the whole file;
4. the default, defined once, in the model that uses it (:class:`~rollsafe.RunConfig`,
   :class:`~rollsafe.PhaseOptions`, :class:`~rollsafe.SupervisorConfig`).

The Temporal connection is Temporal's own: a TOML profile and ``TEMPORAL_*`` variables, as the
``temporal`` CLI reads them (:meth:`ConnectionSettings.from_environment`); what the
``temporal:`` section sets goes on top. Unknown keys are refused, naming the key and where it
came from; :meth:`Settings.origins` says where each value came from (``rollsafe config show``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings.sources.utils import parse_env_vars

from rollsafe.core.config import (
    KEEP_LATEST_K,
    DataplaneName,
    RestoreLevelName,
    RunConfig,
    SamplerName,
)
from rollsafe.core.ids import validate_run_id
from rollsafe.errors import InvalidInput
from rollsafe.http.bearer import ENGINE_TOKEN_ENV, ENV_TOKEN_ENV, read_token_file
from rollsafe.temporal.connect import ConnectionSettings, config_sources
from rollsafe.workflows.models import PhaseOptions, SupervisorConfig

ENV_PREFIX = "ROLLSAFE_"
NESTED = "__"
CONFIG_ENV = "ROLLSAFE_CONFIG"  # a YAML file of settings
SECTION = "rollsafe"  # the section read from a framework's whole config file
DEFAULT = "default"
_MASK = "**********"  # how a secret shows (pydantic's own SecretStr mask)

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
LogFormat = Literal["text", "json"]


def _default(model: type[BaseModel], name: str) -> Any:
    """A default as the model that uses it defines it: defined once, there."""
    return model.model_fields[name].get_default(call_default_factory=True)


class RunSection(BaseModel):
    """The run's shape and sampling (:class:`~rollsafe.RunConfig`, less its run id)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group_size: int | None = Field(default=None, ge=1, le=1024)  # rollouts per prompt
    groups_per_step: int | None = Field(default=None, ge=1)  # prompts per optimizer step
    sampler: SamplerName = _default(RunConfig, "sampler")
    staleness_window: int = Field(default=_default(RunConfig, "staleness_window"), ge=0)
    # None: the most lossless level the run's participants support (default_restore_level).
    restore_level: RestoreLevelName | None = None
    journal: bool = _default(RunConfig, "journal")  # a durable journal between snapshots
    journal_flush_ms: float = Field(default=_default(RunConfig, "journal_flush_ms"), gt=0)


class SnapshotsSection(BaseModel):
    """When snapshots are taken and how many are kept."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Seconds between periodic snapshots; None: only when asked (snapshot_now, an anchor).
    interval_s: float | None = Field(default=_default(SupervisorConfig, "interval_s"), gt=0)
    keep_latest_k: int = Field(default=KEEP_LATEST_K, ge=1)
    max_consecutive_failures: int = Field(
        default=_default(SupervisorConfig, "max_consecutive_failures"), ge=1
    )
    # Where drafts of an object-storage root are staged (a local path); None: a temp dir.
    cache: str | None = None


class ParticipantsSection(BaseModel):
    """The run's environment instances and engines, which each snapshot parks and cuts and a
    restore brings back (docs/design.md section 5); empty: the run has none. Their bearer
    tokens come from files, or from the variables the servers themselves read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    envs: dict[str, str] = {}  # instance name -> URL of its `rollsafe env serve`
    engines: dict[str, str] = {}  # engine name -> URL of its `rollsafe engine serve`
    # A token file, when given, is read instead of the variable.
    env_token_file: Path | None = None  # default: the variable ROLLSAFE_ENV_TOKEN
    engine_token_file: Path | None = None  # default: the variable ROLLSAFE_ENGINE_TOKEN

    def engine_token(self, env: Mapping[str, str] | None = None) -> str:
        """The engines' bearer token (InvalidInput naming where it was sought)."""
        environ = os.environ if env is None else env
        return _token(self.engine_token_file, ENGINE_TOKEN_ENV, environ)

    def env_token(self, env: Mapping[str, str] | None = None) -> str:
        """The environment instances' bearer token (InvalidInput naming where it was sought)."""
        environ = os.environ if env is None else env
        return _token(self.env_token_file, ENV_TOKEN_ENV, environ)


class TemporalSection(BaseModel):
    """Overrides of Temporal's own client config; None: what the profile and ``TEMPORAL_*``
    say (Temporal's defaults: 127.0.0.1:7233, namespace ``default``, no TLS)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profile: str | None = None  # a profile of Temporal's TOML config (TEMPORAL_PROFILE)
    address: str | None = None
    namespace: str | None = None
    api_key: SecretStr | None = None
    tls: bool | None = None
    tls_server_ca_cert_path: Path | None = None
    tls_server_name: str | None = None
    tls_client_cert_path: Path | None = None
    tls_client_key_path: Path | None = None


class TelemetrySection(BaseModel):
    """Logs. Traces and metrics follow OpenTelemetry's own ``OTEL_*`` variables
    (docs/operations.md, "Telemetry")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    log_level: LogLevel = "INFO"
    log_format: LogFormat = "text"

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


class EffectiveSetting(BaseModel):
    """One row of ``rollsafe config show``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str  # dotted: snapshots.interval_s
    value: Any  # as JSON shows it; a secret as "**********"
    source: str  # default, env NAME, file PATH, mapping, profile 'P' in FILE


class Settings(BaseSettings):
    """Everything a user sets, each default defined once (see the module's docstring)."""

    model_config = SettingsConfigDict(
        extra="forbid", frozen=True, env_prefix=ENV_PREFIX, env_nested_delimiter=NESTED
    )

    run_id: str | None = None
    # A directory (local disk or a shared POSIX mount) or object storage (s3://, gs://).
    snapshot_root: str | None = None
    dataplane: DataplaneName = "memory"
    # Ray's own variable, as `ray.init` reads it; None: a local Ray or the one this joined.
    ray_address: str | None = Field(
        default=None, validation_alias=AliasChoices("ray_address", "RAY_ADDRESS")
    )
    run: RunSection = RunSection()
    snapshots: SnapshotsSection = SnapshotsSection()
    phases: PhaseOptions = PhaseOptions()
    participants: ParticipantsSection = ParticipantsSection()
    temporal: TemporalSection = TemporalSection()
    telemetry: TelemetrySection = TelemetrySection()

    _origins: dict[str, str] = PrivateAttr(default_factory=dict)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """``Settings(...)`` resolves as :meth:`load` does: its keywords over the environment
        over ``ROLLSAFE_CONFIG``'s file over the defaults (no dotenv, no secrets directory).
        :meth:`load` adds where each value came from, and errors naming it."""
        return init_settings, env_settings, _ConfigFileSource(settings_cls)

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str | None) -> str | None:
        return None if value is None else validate_run_id(value)

    @classmethod
    def load(
        cls,
        mapping: Mapping[str, Any] | None = None,
        *,
        file: Path | str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Self:
        """Settings from ``mapping`` over the environment over ``file`` (default: the file
        ``ROLLSAFE_CONFIG`` names, if any) over the defaults. ``env`` replaces
        ``os.environ`` (tests). Raises :class:`InvalidInput` naming each bad or unknown key
        and where it came from."""
        environ = os.environ if env is None else env
        layers: list[tuple[str, dict[str, Any]]] = []
        file = file if file is not None else environ.get(CONFIG_ENV)
        if file:
            layers.append((f"file {file}", _file_layer(Path(file))))
        layers.append(("env", _env_layer(cls, environ)))
        if mapping is not None:
            layers.append(("mapping", _plain(mapping, "mapping")))
        merged: dict[str, Any] = {}
        origins: dict[str, str] = {}
        for source, layer in layers:
            _merge(merged, layer, source, origins, ())
        try:
            settings = cls.model_validate(merged)
        except ValidationError as exc:
            raise InvalidInput(_describe(exc, origins)) from None
        settings._origins = origins
        return settings

    def origins(self) -> dict[str, str]:
        """Where each leaf value came from, by dotted key: ``default``, ``env NAME``,
        ``file PATH`` or ``mapping``."""
        return {key: self._origins.get(key, DEFAULT) for key in _leaves(self)}

    def effective(self, env: Mapping[str, str] | None = None) -> list[EffectiveSetting]:
        """Every setting's value and where it came from, as ``rollsafe config show`` prints
        them: the Temporal connection as it will be used (Temporal's own config under the
        ``temporal:`` section), secrets masked."""
        environ = os.environ if env is None else env
        origins = self.origins()
        level, why = self.restore_level()  # as the run uses it: resolved when not set
        rows = [
            EffectiveSetting(key=key, value=_shown(_lookup(self, key)), source=source)
            if key != "run.restore_level"
            else EffectiveSetting(key=key, value=level, source=why)
            for key, source in origins.items()
            if not key.startswith("temporal.") or key == "temporal.profile"
        ]
        for what, path, variable in (
            ("env", self.participants.env_token_file, ENV_TOKEN_ENV),
            ("engine", self.participants.engine_token_file, ENGINE_TOKEN_ENV),
        ):
            present = path is not None or bool(environ.get(variable, "").strip())
            source = f"file {path}" if path is not None else f"env {variable}"
            rows.append(
                EffectiveSetting(
                    key=f"participants.{what}_token",
                    value=_MASK if present else None,
                    source=source if present else "not set",
                )
            )
        connection = self.connection(env=env)
        # As the worker connects: the profile the section or TEMPORAL_PROFILE names, from the
        # file TEMPORAL_CONFIG_FILE names, under the TEMPORAL_* variables and the section.
        temporal = config_sources(
            self.temporal.profile, given_by=origins["temporal.profile"], env=env
        )
        rows = [
            row
            if row.key != "temporal.profile"
            else EffectiveSetting(
                key=row.key, value=temporal.profile, source=temporal.profile_source
            )
            for row in rows
        ]
        for name in ConnectionSettings.model_fields:
            key = f"temporal.{name}"
            source = origins.get(key, DEFAULT)
            if source == DEFAULT:
                source = temporal.fields[name]
            rows.append(
                EffectiveSetting(key=key, value=_shown(getattr(connection, name)), source=source)
            )
        return rows

    def require_run_id(self) -> str:
        if self.run_id is None:
            raise InvalidInput(
                "no run id: set ROLLSAFE_RUN_ID, or run_id in the rollsafe settings section"
            )
        return self.run_id

    def require_snapshot_root(self) -> str:
        if self.snapshot_root is None:
            raise InvalidInput(
                "no snapshot root: set ROLLSAFE_SNAPSHOT_ROOT, or snapshot_root in the rollsafe "
                "settings section (a directory, s3://bucket/prefix or gs://bucket/prefix)"
            )
        return self.snapshot_root

    def restore_level(self) -> tuple[RestoreLevelName, str]:
        """``run.restore_level`` as the run uses it, and why: set, or the default for the
        participants (:func:`default_restore_level`)."""
        if self.run.restore_level is not None:
            return self.run.restore_level, self.origins()["run.restore_level"]
        level, why = default_restore_level(self.participants)
        return level, f"default: {why}"

    def run_config(self, **overrides: Any) -> RunConfig:
        """The controller's :class:`RunConfig`: the run id and the ``run:`` section, with
        ``overrides`` (e.g. ``group_size=8``) on top."""
        fields = {"run_id": self.require_run_id(), **self.run.model_dump(), **overrides}
        if fields["restore_level"] is None:
            fields["restore_level"] = self.restore_level()[0]
        missing = [name for name in ("group_size", "groups_per_step") if fields[name] is None]
        if missing:
            keys = ", ".join(f"run.{name}" for name in missing)
            variables = ", ".join(f"{ENV_PREFIX}RUN{NESTED}{name.upper()}" for name in missing)
            raise InvalidInput(f"settings: {keys} not set ({variables}, or pass it)")
        try:
            return RunConfig(**fields)
        except ValidationError as exc:
            raise InvalidInput(_describe(exc, {})) from None

    def supervisor_config(
        self,
        run_id: str | None = None,
        *,
        participants: bool = True,
        interval_s: float | None = None,
        max_consecutive_failures: int | None = None,
        options: PhaseOptions | None = None,
    ) -> SupervisorConfig:
        """The checkpoint supervisor's settings (``snapshots:``, ``phases:``); the keywords
        given (not None) override them."""
        fields = {
            "interval_s": self.snapshots.interval_s,
            "max_consecutive_failures": self.snapshots.max_consecutive_failures,
            "options": self.phases,
        }
        given = {
            "interval_s": interval_s,
            "max_consecutive_failures": max_consecutive_failures,
            "options": options,
        }
        fields.update({key: value for key, value in given.items() if value is not None})
        try:
            return SupervisorConfig(
                run_id=run_id or self.require_run_id(), participants=participants, **fields
            )
        except ValidationError as exc:
            raise InvalidInput(_describe(exc, {})) from None

    def connection(self, env: Mapping[str, str] | None = None) -> ConnectionSettings:
        """Temporal's own client config (profile, ``TEMPORAL_*``) with the ``temporal:``
        section's values on top."""
        section = self.temporal
        base = ConnectionSettings.from_environment(section.profile, env=env)
        overrides = section.model_dump(exclude_none=True, exclude={"profile"})
        try:
            return ConnectionSettings.model_validate({**base.model_dump(), **overrides})
        except ValidationError as exc:
            raise InvalidInput(f"settings temporal: {_describe(exc, {})}") from None


def default_restore_level(participants: ParticipantsSection) -> tuple[RestoreLevelName, str]:
    """The most lossless restore level the run's participants support, and why: ``prefix``
    with an engine (a cut call resumes from its staged tokens), ``turn`` with environments
    only (an episode continues from its parked turn), else :class:`RunConfig`'s own default
    (no participant holds anything finer than a sibling's row)."""
    if participants.engines:
        return "prefix", "participants.engines is set (a cut call resumes token for token)"
    if participants.envs:
        return "turn", "participants.envs is set, no engine (episodes continue at their turn)"
    level: RestoreLevelName = _default(RunConfig, "restore_level")
    return level, "no participants"


def _token(path: Path | None, variable: str, environ: Mapping[str, str]) -> str:
    if path is not None:
        return read_token_file(path, "participants: the token file")
    token = environ.get(variable, "").strip()
    if not token:
        raise InvalidInput(f"participants: no bearer token in the variable {variable}")
    return token


class _ConfigFileSource(PydanticBaseSettingsSource):
    """The YAML file ``ROLLSAFE_CONFIG`` names, as a source of ``Settings(...)``."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the whole file at once

    def __call__(self) -> dict[str, Any]:
        file = os.environ.get(CONFIG_ENV)
        return _file_layer(Path(file)) if file else {}


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of os.environ
    (:meth:`Settings.load`'s ``env``: tests, ``config show``): pydantic-settings has no public
    way to give its source a mapping, so this replaces the one method that reads
    os.environ."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(
            self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str
        )


def _env_layer(cls: type[BaseSettings], environ: Mapping[str, str]) -> dict[str, Any]:
    return dict(_MappingEnvSource(cls, environ)())


def _file_layer(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidInput(f"settings file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise InvalidInput(f"settings file {path} is not YAML: {exc}") from None
    if loaded is None:
        return {}
    layer = _plain(loaded, f"settings file {path}")
    section = layer.get(SECTION, layer)
    return _plain(section, f"settings file {path}, section {SECTION}")


def _plain(value: Any, what: str) -> dict[str, Any]:
    """A mapping (an OmegaConf DictConfig too) as plain nested dicts."""
    if not isinstance(value, Mapping):
        raise InvalidInput(f"{what}: expected a mapping of settings, got {type(value).__name__}")
    return {
        str(key): _plain(item, what) if isinstance(item, Mapping) else _plain_item(item)
        for key, item in value.items()
    }


def _plain_item(item: Any) -> Any:
    # OmegaConf ListConfig is a Sequence but not a list: pydantic wants a list.
    if isinstance(item, (str, bytes)) or not hasattr(item, "__iter__"):
        return item
    return list(item)


def _sections(model: type[BaseModel], prefix: str = "") -> set[str]:
    """The dotted paths of the nested models (``run``, ``snapshots``, ...): a layer's mapping
    there is merged key by key. Any other mapping (``participants.envs``) is one value, which
    a higher layer replaces whole."""
    found: set[str] = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found |= {f"{prefix}{name}", *_sections(annotation, f"{prefix}{name}.")}
    return found


def _merge(
    into: dict[str, Any],
    layer: Mapping[str, Any],
    source: str,
    origins: dict[str, str],
    path: tuple[str, ...],
) -> None:
    for key, value in layer.items():
        where = (*path, key)
        section = ".".join(where) in _SECTIONS
        if section and isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, source, origins, where)
            continue
        into[key] = value
        _record(origins, where, value, source)


def _record(origins: dict[str, str], path: tuple[str, ...], value: Any, source: str) -> None:
    dotted = ".".join(path)
    if dotted in _SECTIONS and isinstance(value, dict):
        for key, item in value.items():
            _record(origins, (*path, key), item, source)
        return
    origins[dotted] = f"env {_env_name(path)}" if source == "env" else source


def _env_name(path: tuple[str, ...]) -> str:
    if path == ("ray_address",) or path == ("RAY_ADDRESS",):
        return "RAY_ADDRESS"
    return ENV_PREFIX + NESTED.join(part.upper() for part in path)


def _describe(exc: ValidationError, origins: Mapping[str, str]) -> str:
    problems = []
    for error in exc.errors():
        dotted = ".".join(str(part) for part in error["loc"])
        where = origins.get(dotted)
        source = f" (from {where})" if where else ""
        if error["type"] == "extra_forbidden":
            problems.append(f"unknown key {dotted!r}{source}")
        else:
            problems.append(f"{dotted}: {error['msg']}{source}")
    return "settings: " + "; ".join(problems)


def _lookup(model: BaseModel, dotted: str) -> Any:
    value: Any = model
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _shown(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return str(value)  # pydantic masks it
    if isinstance(value, Path):
        return str(value)
    return value


def _leaves(model: BaseModel, prefix: str = "") -> list[str]:
    keys: list[str] = []
    fields: dict[str, FieldInfo] = type(model).model_fields
    for name in fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            keys.extend(_leaves(value, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
    return keys


_SECTIONS = _sections(Settings)
