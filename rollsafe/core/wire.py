"""Messages an earlier rollsafe still reads: a field added to a message after its first release
is left out of the JSON while it holds its default, so a peer of an earlier version (whose
models forbid unknown fields) reads every message it did before; only a message that uses the
new field needs the new version."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def omit_unused(data: Any, model: BaseModel, *fields: str) -> Any:
    """``data`` (``model`` serialized by its handler) without each of ``fields`` that holds
    its default. For a ``model_serializer(mode="wrap")``."""
    if isinstance(data, dict):
        declared = type(model).model_fields
        for name in fields:
            if getattr(model, name) == declared[name].get_default(call_default_factory=True):
                data.pop(name, None)
    return data
