"""Shared test helpers (fixtures only: test modules are imported in importlib mode)."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def resign_snapshot(snapshot: Path, relpath: str, mutate: Callable[[bytes], bytes]) -> None:
    """Change one file of a published snapshot and fix every digest that covers it, so the
    snapshot verifies but holds different content: the case only row digests can catch."""
    target = snapshot / relpath
    data = mutate(target.read_bytes())
    target.write_bytes(data)
    manifest = json.loads((snapshot / "manifest.json").read_text())
    if relpath.startswith("dataplane/"):
        inner = json.loads((snapshot / "dataplane.json").read_text())
        for entry in inner["files"]:
            if f"dataplane/{entry['path']}" == relpath:
                entry.update(sha256=_sha(data), bytes=len(data))
        encoded = json.dumps(inner).encode()
        (snapshot / "dataplane.json").write_bytes(encoded)
        manifest["files"]["dataplane.json"] = {"sha256": _sha(encoded), "bytes": len(encoded)}
    manifest["files"][relpath] = {"sha256": _sha(data), "bytes": len(data)}
    (snapshot / "manifest.json").write_text(json.dumps(manifest))


def flip_first_int32(data: bytes) -> bytes:
    """Flip one bit in the first int32 data tensor of a safetensors file (a token of a row)."""
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    name = next(n for n, s in header.items() if n.endswith(".data") and s["dtype"] == "I32")
    at = 8 + header_len + header[name]["data_offsets"][0]
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root with its sha256: compare before/after to prove nothing changed."""
    return {
        str(path.relative_to(root)): _sha(path.read_bytes())
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.fixture
def resign() -> Callable[[Path, str, Callable[[bytes], bytes]], None]:
    return resign_snapshot


@pytest.fixture
def flip_a_token() -> Callable[[bytes], bytes]:
    return flip_first_int32


@pytest.fixture
def snapshot_tree() -> Callable[[Path], dict[str, str]]:
    return tree_digest
