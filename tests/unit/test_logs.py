"""configure_logging: the text line's shape, one JSON object per line with its fields and every
extra (Temporal's included, made JSON-safe), levels, and a second call that replaces the
handler instead of doubling lines."""

from __future__ import annotations

import io
import json
import logging
import re
from datetime import datetime
from enum import Enum
from pathlib import Path

import pytest
from temporalio import activity, workflow

from rollsafe.core.phases import Phase
from rollsafe.errors import InvalidInput
from rollsafe.observability.logs import (
    LOG_FORMATS,
    LOG_LEVELS,
    LOGGERS,
    configure_logging,
    json_safe,
)
from rollsafe.settings import TelemetrySection

TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) ([\w.]+): (.*)$"
)


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_the_choices_are_the_settings_literals() -> None:
    assert LOG_LEVELS == ("DEBUG", "INFO", "WARNING", "ERROR")
    assert LOG_FORMATS == ("text", "json")
    section = TelemetrySection(log_level="debug", log_format="json")
    stream = io.StringIO()
    configure_logging(section.log_level, section.log_format, stream)
    logging.getLogger("rollsafe.x").debug("seen")
    assert json.loads(lines(stream)[0])["level"] == "DEBUG"


def test_a_text_line_is_time_level_logger_message() -> None:
    stream = io.StringIO()
    configure_logging("INFO", "text", stream)
    logging.getLogger("rollsafe.checkpoint.controller").info("phase %s done", "capture")
    [line] = lines(stream)
    match = TEXT_LINE.match(line)
    assert match is not None, line
    assert match.groups() == ("INFO", "rollsafe.checkpoint.controller", "phase capture done")


def test_the_level_filters_both_hierarchies_and_nothing_else() -> None:
    stream = io.StringIO()
    configure_logging("warning", "text", stream)
    logging.getLogger("rollsafe.a").info("not shown")
    logging.getLogger("rollsafe.a").warning("shown")
    logging.getLogger("temporalio.worker").error("temporal shown")
    logging.getLogger("someone.else").error("not ours")
    assert [TEXT_LINE.match(line).group(3) for line in lines(stream)] == [  # type: ignore[union-attr]
        "shown",
        "temporal shown",
    ]


def test_a_json_line_has_the_fields_and_every_extra() -> None:
    stream = io.StringIO()
    configure_logging("INFO", "json", stream)
    logging.getLogger("rollsafe.activities.snapshot").warning(
        "phase %s failed",
        "drain",
        extra={"checkpoint_id": "r.rollout.00000001", "replayed": False, "seconds": 0.25},
    )
    [line] = lines(stream)
    record = json.loads(line)
    assert record == {
        "ts": record["ts"],
        "level": "WARNING",
        "logger": "rollsafe.activities.snapshot",
        "message": "phase drain failed",
        "checkpoint_id": "r.rollout.00000001",
        "replayed": False,
        "seconds": 0.25,
    }
    when = datetime.fromisoformat(record["ts"])
    assert when.utcoffset() is not None and when.utcoffset().total_seconds() == 0  # type: ignore[union-attr]


def test_temporal_extras_are_fields_and_stay_off_the_json_message() -> None:
    """Temporal's adapters put ``temporal_workflow`` / ``temporal_activity`` in ``extra``; in
    JSON the message is not suffixed with the same dict a second time."""
    stream = io.StringIO()
    configure_logging("INFO", "json", stream)
    assert workflow.logger.workflow_info_on_message is False
    assert activity.logger.activity_info_on_message is False
    details = {"workflow_id": "rollsafe/r", "attempt": 1, "task_queue": "q"}
    logging.getLogger("temporalio.workflow").info("done", extra={"temporal_workflow": details})
    assert json.loads(lines(stream)[0])["temporal_workflow"] == details
    configure_logging("INFO", "text", stream)
    assert workflow.logger.workflow_info_on_message is True


def test_an_exception_and_odd_values_still_make_valid_json() -> None:
    class Color(Enum):
        RED = "red"

    stream = io.StringIO()
    configure_logging("INFO", "json", stream)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("rollsafe.x").exception(
            "failed",
            extra={
                "phase": Phase.CAPTURE,
                "where": Path("/tmp/x"),
                "weird": {("a", 1): {1, 2}, "nan": float("nan")},
                "color": Color.RED,
                "obj": object(),
            },
        )
    record = json.loads(lines(stream)[0])
    assert record["phase"] == "capture"
    assert record["where"] == "/tmp/x"
    assert record["weird"] == {"('a', 1)": [1, 2], "nan": "nan"}
    assert record["color"] == "red"
    assert record["obj"].startswith("<object object")
    assert record["exception"].startswith("Traceback") and "ValueError: boom" in record["exception"]


def test_a_second_call_replaces_the_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("INFO", "text", first)
    configure_logging("DEBUG", "json", second)
    logging.getLogger("rollsafe.y").debug("once")
    assert lines(first) == []
    assert [json.loads(line)["message"] for line in lines(second)] == ["once"]
    for name in LOGGERS:
        assert len(logging.getLogger(name).handlers) == 1


def test_lines_do_not_reach_the_root_handlers_again(caplog: pytest.LogCaptureFixture) -> None:
    stream = io.StringIO()
    configure_logging("INFO", "text", stream)
    logging.getLogger("rollsafe.z").info("one line")
    assert len(lines(stream)) == 1
    assert "one line" not in caplog.text


@pytest.mark.parametrize(("level", "fmt"), [("TRACE", "text"), ("INFO", "yaml")])
def test_unknown_choices_are_refused_by_name(level: str, fmt: str) -> None:
    with pytest.raises(InvalidInput, match="expected one of"):
        configure_logging(level, fmt, io.StringIO())


def test_json_safe_bounds_depth() -> None:
    """Beyond its bound (8 levels) an extra is written as its repr, so a deep or cyclic value
    never recurses without end; above it every level is kept as JSON."""
    nested: dict[str, object] = {}
    inner = nested
    for _ in range(20):
        inner["x"] = {}
        inner = inner["x"]  # type: ignore[assignment]
    safe = json_safe(nested)
    for _ in range(8):
        assert isinstance(safe, dict) and set(safe) == {"x"}
        safe = safe["x"]
    assert isinstance(safe, str) and safe.startswith("{'x': {")  # the repr of what is left
    cyclic: list[object] = []
    cyclic.append(cyclic)
    json.loads(json.dumps(json_safe(cyclic)))  # bounded: valid JSON, no RecursionError
