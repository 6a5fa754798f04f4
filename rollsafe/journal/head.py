"""The journal's ``HEAD``: which segment is the newest, so that a missing one is seen.

Segment names say where each segment starts, and the records say whether one follows another;
neither says whether a *newer* segment existed. ``<journal>/HEAD`` does (JSON, replaced
atomically)::

    {"head_version": 1, "run_id": ..., "journal_id": ..., "newest": <its first record id>,
     "digest": <sha256 of the canonical JSON of the other fields, as a manifest's>}

The writer names a new segment here *before* its draft takes its segment name: a segment never
exists without a ``HEAD`` naming it or a newer one, and a ``HEAD`` whose segment is missing
while its draft is still there is a crash between the two steps (benign: the draft never held
a record). Anything else missing is a gap a restore names (docs/journal.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError

from rollsafe.core.ids import RUN_ID_PATTERN
from rollsafe.errors import JournalCorrupt
from rollsafe.snapshot._fs import write_atomic
from rollsafe.snapshot.bounded import parse_json, read_regular
from rollsafe.snapshot.manifest import JOURNAL_ID_PATTERN, digest_matches, with_digest

HEAD_NAME = "HEAD"
HEAD_MAX_BYTES = 4096


class Head(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    head_version: Literal[1] = 1
    run_id: str = Field(pattern=RUN_ID_PATTERN.pattern)
    journal_id: str = Field(pattern=JOURNAL_ID_PATTERN)
    newest: NonNegativeInt  # the first record id of the newest segment


def write_head(directory: Path, head: Head) -> None:
    """Replace ``HEAD`` (temporary file, fsync, rename, fsync of the folder)."""
    sealed = with_digest(head.model_dump(mode="json"))
    write_atomic(directory / HEAD_NAME, (json.dumps(sealed, indent=2) + "\n").encode())


def read_head(directory: Path) -> Head | None:
    """The journal's ``HEAD``; None when there is none; :class:`JournalCorrupt` naming it when
    it cannot be read, does not parse, or its digest does not match its fields."""
    path = directory / HEAD_NAME
    try:
        raw = parse_json(read_regular(path, limit=HEAD_MAX_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise JournalCorrupt(f"{path}: unreadable ({exc})") from None
    if not isinstance(raw, dict) or "digest" not in raw:
        raise JournalCorrupt(f"{path}: not a journal HEAD (no digest field)")
    if not digest_matches(raw):
        raise JournalCorrupt(f"{path}: its digest does not match its fields (edited or damaged)")
    try:
        return Head.model_validate(
            {name: value for name, value in raw.items() if name != "digest"}, strict=True
        )
    except ValidationError as exc:
        problem = exc.errors(include_url=False)[0]
        raise JournalCorrupt(f"{path}: {problem['msg']} at {problem['loc']}") from None
