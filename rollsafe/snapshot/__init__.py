"""The on-disk snapshot format (schema version 2): drafts, atomic publish, select, retention.

See docs/design.md sections 3 (invariant 7), 5 ("publish"), 6 ("select") and 10.
"""

from rollsafe.snapshot.draft import SnapshotDraft
from rollsafe.snapshot.manifest import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    FileEntry,
    LatestPointer,
    SnapshotKind,
    SnapshotManifest,
    canonical_sha256,
    digest_matches,
    parse_latest,
    parse_manifest,
    validate_relpath,
    with_digest,
)
from rollsafe.snapshot.select import (
    Accept,
    EntryState,
    SnapshotEntry,
    SnapshotReader,
    accept_at_or_below,
    accept_weight_versions,
    verify_snapshot,
)
from rollsafe.snapshot.store import FAULT_POINTS, PublishedSnapshot, SnapshotStore

__all__ = [
    "FAULT_POINTS",
    "MANIFEST_NAME",
    "SCHEMA_VERSION",
    "Accept",
    "EntryState",
    "FileEntry",
    "LatestPointer",
    "PublishedSnapshot",
    "SnapshotDraft",
    "SnapshotEntry",
    "SnapshotKind",
    "SnapshotManifest",
    "SnapshotReader",
    "SnapshotStore",
    "accept_at_or_below",
    "accept_weight_versions",
    "canonical_sha256",
    "digest_matches",
    "parse_latest",
    "parse_manifest",
    "validate_relpath",
    "verify_snapshot",
    "with_digest",
]
