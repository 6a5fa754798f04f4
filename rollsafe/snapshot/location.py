"""Which snapshot store a location names: a POSIX directory (the default) or object storage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollsafe.errors import InvalidInput
from rollsafe.snapshot._objects import SCHEMES
from rollsafe.snapshot.remote import RemoteSnapshotStore
from rollsafe.snapshot.store import FaultHook, SnapshotStore


def open_snapshot_store(
    location: str | Path,
    run_id: str,
    *,
    cache_dir: Path | str | None = None,
    keep_latest_k: int = 2,
    storage_options: dict[str, Any] | None = None,
    fault_hook: FaultHook | None = None,
) -> SnapshotStore:
    """The store for ``location``: a path (or file:// URL) is a POSIX store, the default
    (a local disk or a shared POSIX mount); s3:// and gs:// are object storage, staged and
    cached under ``cache_dir``. Any other scheme is refused by name."""
    text = str(location)
    scheme = text.split("://", 1)[0] if "://" in text else ""
    if scheme in ("", "file"):
        root = Path(text.removeprefix("file://"))
        return SnapshotStore(root, run_id, keep_latest_k, fault_hook=fault_hook)
    if scheme in SCHEMES and cache_dir is None:
        raise InvalidInput(f"{text!r}: object storage needs a local cache_dir for drafts")
    return RemoteSnapshotStore(
        text,
        run_id,
        cache_dir or "",
        keep_latest_k,
        storage_options=storage_options,
        fault_hook=fault_hook,
    )
