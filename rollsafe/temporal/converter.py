"""rollsafe's Temporal data converter: pydantic JSON, each payload stamped with the contract
that wrote it, and a payload of the next contract read without the fields this release does
not know (rollsafe.versions).

Every client, worker and replayer of rollsafe uses :data:`data_converter`. Writing is the
pydantic converter's, plus the metadata key ``rollsafe-contract``. Reading is strict (every
model forbids unknown fields) except for a payload stamped with a later contract: its unknown
fields are the next release's additions, which it writes only when they are used
(``rollsafe.core.wire.Evolving``); a release that needs its reader to understand a field takes
a contract number this one does not support. Those fields are dropped, once logged as a
WARNING per model and field, and the rest validated as usual. A payload of a contract more
than one apart is refused (VersionSkew) before it is validated: its fields may mean other
things.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from pydantic import ValidationError
from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import (
    PydanticJSONPlainPayloadConverter,
    PydanticPayloadConverter,
)
from temporalio.converter import DataConverter

from rollsafe.versions import CONTRACT, UNVERSIONED, Peer, check_peer

CONTRACT_KEY = "rollsafe-contract"
log = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def written_by(payload: Payload) -> int:
    """The contract a payload was written with; unstamped: a release before contracts."""
    raw = payload.metadata.get(CONTRACT_KEY)
    try:
        return int(raw) if raw is not None else UNVERSIONED
    except ValueError:
        return UNVERSIONED


def _drop(data: Any, loc: tuple[int | str, ...]) -> None:
    """Remove the field at ``loc`` (a pydantic error location) from parsed JSON ``data``."""
    *path, last = loc
    for key in path:
        data = data[key]
    if isinstance(data, dict):
        data.pop(last, None)


class ContractJSONConverter(PydanticJSONPlainPayloadConverter):
    def to_payload(self, value: Any) -> Payload | None:
        payload = super().to_payload(value)
        if payload is not None:
            payload.metadata[CONTRACT_KEY] = str(CONTRACT).encode()
        return payload

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        writer = written_by(payload)
        if writer != CONTRACT:
            check_peer("a Temporal payload", Peer(release="?", contract=writer))
        try:
            return super().from_payload(payload, type_hint)
        except ValidationError as exc:
            unknown = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
            if writer <= CONTRACT or len(unknown) != exc.error_count():
                raise
            data = json.loads(payload.data)
            for loc in unknown:
                _drop(data, loc)
            _warn_dropped(type_hint, writer, unknown)
            return self._type_adapter(type_hint).validate_python(data)


def _warn_dropped(type_hint: Any, writer: int, unknown: list[tuple[int | str, ...]]) -> None:
    model = getattr(type_hint, "__name__", str(type_hint))
    for loc in unknown:
        field = ".".join(map(str, loc))
        with _warned_lock:
            if (model, field) in _warned:
                continue
            _warned.add((model, field))
        log.warning(
            "a %s payload of contract %d (this release: %d) has field %r this release does "
            "not know: ignored (a rollback of one release; rollsafe.versions)",
            model,
            writer,
            CONTRACT,
            field,
        )


class ContractPayloadConverter(PydanticPayloadConverter):
    """The pydantic payload converter with :class:`ContractJSONConverter` for JSON."""

    def __init__(self) -> None:
        super().__init__()
        self._set_converters(
            *(
                ContractJSONConverter()
                if isinstance(converter, PydanticJSONPlainPayloadConverter)
                else converter
                for converter in self.converters.values()
            )
        )


data_converter = DataConverter(payload_converter_class=ContractPayloadConverter)
