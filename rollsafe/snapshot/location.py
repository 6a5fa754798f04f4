"""Which snapshot store a location names: a POSIX directory (the default) or object storage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollsafe.core.config import KEEP_LATEST_K
from rollsafe.errors import InvalidInput
from rollsafe.snapshot._objects import SCHEMES
from rollsafe.snapshot.remote import RemoteSnapshotStore
from rollsafe.snapshot.store import FaultHook, SnapshotStore


def parse_location(location: str | Path) -> Path | str:
    """A POSIX directory (a path, or a file:// URL) as a Path; anything else, the URL of
    object storage as given (:func:`open_snapshot_store` refuses an unknown scheme)."""
    if isinstance(location, Path):
        return location
    if "://" not in location:
        return Path(location)
    if location.split("://", 1)[0] == "file":
        return Path(location.removeprefix("file://"))
    return location


def open_snapshot_store(
    location: str | Path,
    run_id: str,
    *,
    cache_dir: Path | str | None = None,
    keep_latest_k: int = KEEP_LATEST_K,
    storage_options: dict[str, Any] | None = None,
    fault_hook: FaultHook | None = None,
) -> SnapshotStore:
    """The store for ``location``: a path (or file:// URL) is a POSIX store, the default
    (a local disk or a shared POSIX mount); s3:// and gs:// are object storage, staged and
    cached under ``cache_dir``. Any other scheme is refused by name."""
    where = parse_location(location)
    if isinstance(where, Path):
        return SnapshotStore(where, run_id, keep_latest_k, fault_hook=fault_hook)
    text = where
    if text.split("://", 1)[0] in SCHEMES and cache_dir is None:
        raise InvalidInput(f"{text!r}: object storage needs a local cache_dir for drafts")
    return RemoteSnapshotStore(
        text,
        run_id,
        cache_dir or "",
        keep_latest_k,
        storage_options=storage_options,
        fault_hook=fault_hook,
    )
