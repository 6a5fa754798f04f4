"""Messages an earlier rollsafe still reads: a field added to a message after its first release
is left out of the JSON while it holds its default, so a peer of an earlier version (whose
models forbid unknown fields) reads every message it did before; only a message that uses the
new field needs the new version."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer


def omit_unused(data: Any, model: BaseModel, *fields: str) -> Any:
    """``data`` (``model`` serialized by its handler) without each of ``fields`` that holds
    its default. For a ``model_serializer(mode="wrap")``."""
    if isinstance(data, dict):
        declared = type(model).model_fields
        for name in fields:
            if getattr(model, name) == declared[name].get_default(call_default_factory=True):
                data.pop(name, None)
    return data


class Evolving(BaseModel):
    """A model on a wire between releases (Temporal payloads, controller calls): the fields
    named in ``added`` (added by this release) are written only when they differ from their
    default, so the release before, whose models forbid unknown fields, reads what this one
    writes whenever the new fields are unused (rollsafe.versions)."""

    added: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_added_when_unused(self, handler: SerializerFunctionWrapHandler) -> Any:
        return omit_unused(handler(self), self, *self.added)
