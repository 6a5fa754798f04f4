"""Every on-disk format that gains, loses or retypes a field takes the next version number
(rollsafe.versions; issue 35: files that gained fields under the same number made an older
reader name fields instead of the version that wrote them).

Each format's fields (names, types, constraints, defaults: its JSON schema without titles and
descriptions, nested models included) are fingerprinted per version in
``format_fingerprints.json`` beside this file. A change under the same version fails here; a
new version records its fingerprint with ``ROLLSAFE_RECORD_FORMATS=1`` (the test then fails
once more, naming what it wrote, so the recording is never silent) and keeps the old ones: the
readers of earlier versions stay until their formats are dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from rollsafe.checkpoint.phases.commit_envs import ParticipantsRecord
from rollsafe.core.capture import LoaderState
from rollsafe.dataplane.protocol import DataPlaneManifest
from rollsafe.engine.protocol import PrefixRecord
from rollsafe.engine.scripted import Script
from rollsafe.env.protocol import ParticipantManifest
from rollsafe.gateway.record import SessionRecord
from rollsafe.snapshot.manifest import SnapshotManifest

FINGERPRINTS = Path(__file__).with_name("format_fingerprints.json")
# The on-disk models and the field that carries each one's version.
FORMATS: dict[str, tuple[type[BaseModel], str]] = {
    "snapshot manifest": (SnapshotManifest, "schema_version"),
    "loader.json": (LoaderState, "format_version"),
    "participants.json": (ParticipantsRecord, "format_version"),
    "participant manifest": (ParticipantManifest, "schema_version"),
    "engine prefix": (PrefixRecord, "format_version"),
    "gateway session record": (SessionRecord, "format_version"),
    "data plane export": (DataPlaneManifest, "format_version"),
    "engine script": (Script, "format_version"),
}
_WORDS = {"title", "description", "examples"}


def _fields_only(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _fields_only(v) for k, v in sorted(node.items()) if k not in _WORDS}
    if isinstance(node, list):
        return [_fields_only(v) for v in node]
    return node


def fingerprint(model: type[BaseModel]) -> str:
    schema = _fields_only(model.model_json_schema(mode="serialization"))
    return hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).hexdigest()[:16]


def version_of(model: type[BaseModel], field: str) -> str:
    return str(model.model_fields[field].get_default(call_default_factory=True))


def test_each_format_changed_only_under_a_new_version() -> None:
    recorded: dict[str, dict[str, str]] = json.loads(FINGERPRINTS.read_text())
    recording = os.environ.get("ROLLSAFE_RECORD_FORMATS") == "1"
    wrote, wrong = [], []
    for name, (model, field) in FORMATS.items():
        version, now = version_of(model, field), fingerprint(model)
        known = recorded.setdefault(name, {})
        if known.get(version) == now:
            continue
        if version not in known and recording:
            known[version] = now
            wrote.append(f"{name} {field} {version}")
        elif version not in known:
            wrong.append(f"{name}: {field} {version} has no recorded fields: record them")
        else:
            wrong.append(
                f"{name}: its fields changed but {model.__name__}.{field} is still {version}: "
                "give it the next version (and keep reading this one)"
            )
    if wrote:
        FINGERPRINTS.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")
        pytest.fail(f"recorded {', '.join(wrote)}: run again without ROLLSAFE_RECORD_FORMATS")
    assert not wrong, "; ".join(wrong)


def test_a_changed_field_is_caught() -> None:
    """The fingerprint sees a new field, and not a reworded description."""

    class Before(BaseModel):
        format_version: int = 1
        a: int

    class Added(BaseModel):
        format_version: int = 1
        a: int
        b: int = 0

    class Reworded(BaseModel):
        format_version: int = 1
        a: int

    Reworded.model_fields["a"].description = "now explained"
    Reworded.model_rebuild(force=True)
    assert fingerprint(Before) != fingerprint(Added)
    assert fingerprint(Before) == fingerprint(Reworded)
