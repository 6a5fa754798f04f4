"""Logs of a rollsafe process: one handler on the ``rollsafe`` and ``temporalio`` loggers.

Every module logs to ``logging.getLogger(__name__)``; workflows log to
``temporalio.workflow.logger`` (silent while a history replays) and activities to
``temporalio.activity.logger``, so their lines carry the workflow's or activity's identity.
:func:`configure_logging` (the ``--log-level`` / ``--log-format`` of every long-running
command) decides where those lines go and how they look:

- ``text``: ``2025-01-31 12:00:00,123 INFO rollsafe.checkpoint.controller: ...``;
- ``json``: one object per line, ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``message``,
  then every ``extra`` field the record carries (``run_id``, ``checkpoint_id``, ``phase``, ...;
  Temporal's ``temporal_workflow`` / ``temporal_activity``), ``exception`` when there is one.

The names a command offers as choices are :data:`LOG_LEVELS` and :data:`LOG_FORMATS`, the
values of :data:`rollsafe.settings.LogLevel` / :data:`~rollsafe.settings.LogFormat`
(``telemetry.log_level`` / ``telemetry.log_format`` in the settings).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from enum import Enum
from pathlib import PurePath
from typing import Any, TextIO, get_args

from pydantic import BaseModel

from rollsafe.errors import InvalidInput
from rollsafe.settings import LogFormat, LogLevel

__all__ = [
    "LOGGERS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "TEXT_FORMAT",
    "JsonFormatter",
    "LogFormat",
    "LogLevel",
    "configure_logging",
]

LOG_LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)
LOG_FORMATS: tuple[LogFormat, ...] = get_args(LogFormat)
LOGGERS = ("rollsafe", "temporalio")  # the hierarchies given the handler
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
HANDLER_NAME = "rollsafe"  # how configure_logging finds the handler it installed before

# Attributes every LogRecord has: anything else on a record came from ``extra``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",  # Python 3.12+
}
_MAX_DEPTH = 8  # nested extras beyond this are written as their repr


def configure_logging(
    level: str = "INFO", fmt: LogFormat | str = "text", stream: TextIO | None = None
) -> logging.Handler:
    """Send the ``rollsafe`` and ``temporalio`` loggers' lines at ``level`` and above to
    ``stream`` (default: ``sys.stderr`` as it is when called) in format ``fmt``.

    One handler, replaced on every call (a second call changes level or format and never
    doubles a line). The two loggers stop propagating to the root logger: a root handler the
    application installed would otherwise write each line a second time. Raises
    :class:`InvalidInput` naming the choices for an unknown level or format."""
    name, form = _level(level), _format(fmt)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.set_name(HANDLER_NAME)
    handler.setFormatter(JsonFormatter() if form == "json" else logging.Formatter(TEXT_FORMAT))
    for logger_name in LOGGERS:
        logger = logging.getLogger(logger_name)
        for old in [h for h in logger.handlers if h.get_name() == HANDLER_NAME]:
            logger.removeHandler(old)  # not closed: it may hold the caller's stderr
        logger.addHandler(handler)
        logger.setLevel(name)
        logger.propagate = False
    _temporal_details_on_message(form == "text")
    return handler


def _level(level: str) -> LogLevel:
    name = level.strip().upper() if isinstance(level, str) else level
    if name not in LOG_LEVELS:
        raise InvalidInput(f"log level {level!r}: expected one of {', '.join(LOG_LEVELS)}")
    return name


def _format(fmt: str) -> LogFormat:
    name = fmt.strip().lower() if isinstance(fmt, str) else fmt
    if name not in LOG_FORMATS:
        raise InvalidInput(f"log format {fmt!r}: expected one of {', '.join(LOG_FORMATS)}")
    return name


def _temporal_details_on_message(on: bool) -> None:
    """Temporal's adapters append the workflow's or activity's details to every message and
    put them in ``extra`` too: in JSON they are fields already, so the message stays plain."""
    from temporalio import activity, workflow

    workflow.logger.workflow_info_on_message = on
    activity.logger.activity_info_on_message = on


class JsonFormatter(logging.Formatter):
    """One JSON object per record, every value made JSON-safe (see the module doc)."""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                fields.setdefault(key, json_safe(value))
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            fields["stack"] = self.formatStack(record.stack_info)
        return json.dumps(fields, ensure_ascii=False, allow_nan=False)


def _timestamp(created: float) -> str:
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")


def json_safe(value: Any, depth: int = 0) -> Any:
    """``value`` as something ``json.dumps`` writes as valid JSON: models as their JSON dump,
    enums as their value, string keys, finite numbers (NaN and infinities as strings), and
    anything else unknown as its ``str``."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth >= _MAX_DEPTH:
        return repr(value)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, Enum):
        return json_safe(value.value, depth + 1)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [json_safe(v, depth + 1) for v in value]
    return str(value)
