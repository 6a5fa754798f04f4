"""Damaged, missing and hostile state, made on purpose: a seeded catalogue of mutations of a
run's snapshot root (its snapshots, ``LATEST`` and journal), for the restore fuzz test
(tests/unit/test_restore_fuzz.py) and anyone who wants to try a restore against them.

Each :class:`Mutation` changes one thing the way damage, a crash, an operator or an adversary
would: bytes flipped, cut or appended; files gone, or replaced by a folder, a FIFO or a link to
``/dev/zero``; JSON nested thousands deep; fields edited with or without their digests made to
match (``reseal``), files taken from another snapshot (a chimera), segments of another journal
of a run with the same id, a journal folder that is a file. ``names`` are the words a refusal
must contain to name what is wrong (any one of them).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rollsafe.snapshot import with_digest
from rollsafe.snapshot.tensorfile import HashingWriter, read_tensors, write_tensors

DEEP = 5000  # nesting: ten times what a recursive parser survives


@dataclass(frozen=True)
class Mutation:
    name: str
    apply: Callable[[Path], None]  # given the run's folder (<root>/<run id>)
    names: tuple[str, ...]  # a refusal names one of these


def mutations(run_dir: Path, foreign: Path, seed: int, count: int) -> Iterator[Mutation]:
    """``count`` mutations of the run in ``run_dir``, drawn with ``seed``; ``foreign``: the
    folder of another run with the same run id (its journal's segments are another journal's).
    Each mutation applies to a copy of ``run_dir`` (the folder it is given)."""
    rng = random.Random(seed)
    files = [Rel(run_dir, p) for p in _files(run_dir)]
    snapshots = [Rel(run_dir, p) for p in sorted((run_dir / "snapshots").iterdir()) if p.is_dir()]
    segments = [Rel(run_dir, p) for p in sorted((run_dir / "journal").glob("*.rsj"))]
    foreign_segments = sorted((foreign / "journal").glob("*.rsj"))
    kinds = [
        lambda: _byte_flip(rng, rng.choice(files)),
        lambda: _truncate(rng, rng.choice(files)),
        lambda: _append(rng, rng.choice(files)),
        lambda: _remove(rng.choice(files)),
        lambda: _not_a_file(rng, rng.choice(files)),
        lambda: _deep_json(rng, rng.choice([f for f in files if _is_json(f)])),
        lambda: _deep_tensor_header(rng.choice([f for f in files if f.suffix == ".safetensors"])),
        lambda: _manifest_field(rng, rng.choice(snapshots), reseal=rng.random() < 0.5),
        lambda: _chimera(rng, snapshots),
        lambda: _ledger_attempt(rng.choice(snapshots)),
        lambda: _byte_flip(rng, rng.choice(segments)),
        lambda: _truncate(rng, rng.choice(segments)),
        lambda: _first_record(rng.choice(segments)),
        lambda: _remove(rng.choice([*segments, Rel(run_dir, run_dir / "journal" / "HEAD")])),
        lambda: _journal_gone(rng, Rel(run_dir, run_dir / "journal")),
        lambda: _foreign_segment(rng, segments, foreign_segments),
        lambda: _not_a_file(rng, rng.choice(segments)),
        lambda: _head_edit(rng, Rel(run_dir, run_dir / "journal" / "HEAD")),
        lambda: _run_id_not_utf8(rng.choice(segments)),
        lambda: _segment_copied(rng, segments),
    ]
    for n in range(count):
        mutation = kinds[n % len(kinds)]()
        yield Mutation(f"{n}: {mutation.name}", mutation.apply, mutation.names)


@dataclass(frozen=True)
class Rel:
    """A file or folder of the pristine run (``base``), found again in a copy of it."""

    base: Path
    path: Path  # in base

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def suffix(self) -> str:
        return self.path.suffix

    def __str__(self) -> str:
        return self.path.relative_to(self.base).as_posix()

    def at(self, run_dir: Path) -> Path:
        """The same file in the copy ``run_dir``."""
        return run_dir / self.path.relative_to(self.base)

    def read_bytes(self) -> bytes:
        return self.path.read_bytes()


def _files(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink())


def _is_json(path: Rel) -> bool:
    return path.suffix == ".json" or path.name in ("LATEST", "HEAD")


def _named(path: Rel) -> tuple[str, ...]:
    """What names a file of the run: its own name, or its snapshot's or folder's."""
    return tuple(dict.fromkeys((path.name, *str(path).split("/")[:-1])))


def _edit(path: Rel, change: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def apply(run_dir: Path) -> None:
        target = path.at(run_dir)
        target.write_bytes(change(target.read_bytes()))

    return apply


def _byte_flip(rng: random.Random, path: Rel) -> Mutation:
    size = len(path.read_bytes())
    at, bit = rng.randrange(max(size, 1)), 1 << rng.randrange(8)

    def flip(data: bytes) -> bytes:
        if not data:
            return b"\x00"
        return data[:at] + bytes([data[at] ^ bit]) + data[at + 1 :]

    return Mutation(f"flip byte {at} of {path}", _edit(path, flip), _named(path))


def _truncate(rng: random.Random, path: Rel) -> Mutation:
    keep = rng.randrange(max(len(path.read_bytes()), 1))
    return Mutation(f"cut {path} to {keep} bytes", _edit(path, lambda d: d[:keep]), _named(path))


def _append(rng: random.Random, path: Rel) -> Mutation:
    junk = rng.randbytes(rng.choice([1, 7, 4096]))
    return Mutation(
        f"append {len(junk)} bytes to {path}",
        _edit(path, lambda d: d + junk),
        _named(path),
    )


def _remove(path: Rel) -> Mutation:
    return Mutation(
        f"remove {path}",
        lambda run_dir: path.at(run_dir).unlink(),
        (*_named(path), "missing"),
    )


def _not_a_file(rng: random.Random, path: Rel) -> Mutation:
    what = rng.choice(["folder", "fifo", "link to /dev/zero", "dangling link"])

    def apply(run_dir: Path) -> None:
        target = path.at(run_dir)
        target.unlink()
        if what == "folder":
            target.mkdir()
        elif what == "fifo":
            os.mkfifo(target)
        else:
            target.symlink_to("/dev/zero" if what == "link to /dev/zero" else "nowhere")

    return Mutation(f"{path} made a {what}", apply, _named(path))


def _deep_json(rng: random.Random, path: Rel) -> Mutation:
    opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
    deep = opener * DEEP + b"0" + closer * DEEP
    return Mutation(f"{path} nested {DEEP} deep", _edit(path, lambda _: deep), _named(path))


def _deep_tensor_header(path: Rel) -> Mutation:
    header = b"[" * DEEP + b"]" * DEEP
    data = struct.pack("<Q", len(header)) + header
    return Mutation(f"{path} header nested {DEEP} deep", _edit(path, lambda _: data), _named(path))


def _reseal(manifest: dict[str, Any]) -> dict[str, Any]:
    """A schema 2 manifest with its digest made to match its (edited) fields."""
    return with_digest(manifest) if "digest" in manifest else manifest


def _manifest_field(rng: random.Random, snapshot: Rel, *, reseal: bool) -> Mutation:
    field, value = rng.choice(
        [
            ("loader_position", rng.randrange(0, 50)),
            ("weight_version", rng.randrange(0, 5)),
            # Not resealed: a position is a number nothing else says (a resealed edit is a
            # deliberate rewrite, and the journal cannot tell it from the truth).
            ("counts", {"journal_position": rng.randrange(0, 40)}),
            ("journal_id", "0" * 32),
            ("seq", 99),
            ("run_id", "someone-else"),
            ("checkpoint_id", "ck-other"),
        ]
    )

    def apply(run_dir: Path) -> None:
        path = snapshot.at(run_dir) / "manifest.json"
        manifest = json.loads(path.read_bytes())
        if field == "counts":
            manifest["counts"] = {**manifest["counts"], **value}  # type: ignore[dict-item]
        else:
            manifest[field] = value
        if reseal and field != "counts":
            manifest = _reseal(manifest)
        path.write_text(json.dumps(manifest))

    how = "resealed" if reseal else "digest left"
    return Mutation(
        f"{snapshot.name} manifest {field}={value!r} ({how})",
        apply,
        (snapshot.name, "manifest.json"),
    )


def _chimera(rng: random.Random, snapshots: list[Rel]) -> Mutation:
    """A file of the older snapshot put into the newer one, every digest made to match."""
    older, newer = snapshots[0], snapshots[-1]
    relpath = rng.choice(["loader.json", "ledger.safetensors", "replay_index.safetensors",
                          "sampler.json", "dataplane.json"])  # fmt: skip

    def apply(run_dir: Path) -> None:
        data = (older.at(run_dir) / relpath).read_bytes()
        replace_resealed(newer.at(run_dir), relpath, data)

    return Mutation(f"{newer.name}/{relpath} taken from {older.name}", apply, (newer.name,))


def _ledger_attempt(snapshot: Rel) -> Mutation:
    """A sealed rollout's attempt changed in the ledger, every digest made to match."""

    def apply(run_dir: Path) -> None:
        target = snapshot.at(run_dir)
        arrays, metadata = read_tensors((target / "ledger.safetensors").read_bytes(), "ledger")
        arrays = {name: np.array(array) for name, array in arrays.items()}
        sealed = np.argwhere(arrays["state"] == 2)  # AttemptState.SEALED
        if len(sealed):
            row, sibling = sealed[0]
            arrays["attempt"][row, sibling] += 1
        out = io.BytesIO()
        write_tensors(HashingWriter(out), arrays, metadata)
        replace_resealed(target, "ledger.safetensors", out.getvalue())

    return Mutation(f"{snapshot.name} ledger: a sealed attempt + 1", apply, (snapshot.name,))


def replace_resealed(snapshot: Path, relpath: str, data: bytes) -> None:
    """``relpath`` of ``snapshot`` holds ``data`` now, and the manifest says so, digest and all:
    a change only the checks behind the digests can see."""
    (snapshot / relpath).write_bytes(data)
    manifest = json.loads((snapshot / "manifest.json").read_bytes())
    manifest["files"][relpath] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (snapshot / "manifest.json").write_text(json.dumps(_reseal(manifest)))


def _first_record(path: Rel) -> Mutation:
    """The first record of a segment corrupt: reading finds nothing in it."""
    header = _header_size(path.read_bytes())

    def corrupt(data: bytes) -> bytes:
        at = header + 12  # inside the first record's body
        return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :] if len(data) > at else data

    return Mutation(f"first record of {path} corrupt", _edit(path, corrupt), _named(path))


def _header_size(data: bytes) -> int:
    n = int(struct.unpack_from("<H", data, 10)[0])
    return 12 + n + 16 + 8 + 4


def _journal_gone(rng: random.Random, journal: Rel) -> Mutation:
    what = rng.choice(["removed", "a file"])

    def apply(run_dir: Path) -> None:
        target = journal.at(run_dir)
        shutil.rmtree(target)
        if what == "a file":
            target.write_bytes(b"not a journal")

    return Mutation(f"journal folder {what}", apply, ("journal",))


def _foreign_segment(rng: random.Random, ours: list[Rel], theirs: list[Path]) -> Mutation:
    """A segment of another run with the same run id (another journal) in place of one of ours."""
    mine, stranger = rng.choice(ours), rng.choice(theirs)

    def apply(run_dir: Path) -> None:
        shutil.copyfile(stranger, mine.at(run_dir))

    return Mutation(f"{mine} replaced by another journal's", apply, (*_named(mine),))


def _head_edit(rng: random.Random, head: Rel) -> Mutation:
    value = rng.choice([0, 1, 10**6])

    def apply(run_dir: Path) -> None:
        path = head.at(run_dir)
        data = json.loads(path.read_bytes())
        data["newest"] = value
        path.write_text(json.dumps(data))

    return Mutation(f"journal HEAD newest={value}", apply, ("HEAD",))


def _run_id_not_utf8(path: Rel) -> Mutation:
    """The header's run id bytes not UTF-8, its checksum made to match."""

    def change(data: bytes) -> bytes:
        n = int(struct.unpack_from("<H", data, 10)[0])
        end = _header_size(data) - 4
        head = data[:12] + b"\xff" * n + data[12 + n : end]
        return head + struct.pack("<I", zlib.crc32(head)) + data[end + 4 :]

    return Mutation(f"{path} run id not UTF-8", _edit(path, change), _named(path))


def _segment_copied(rng: random.Random, segments: list[Rel]) -> Mutation:
    """A segment copied under the name of a later one: its header disagrees with its name."""
    source = rng.choice(segments)
    first = int(source.name.removesuffix(".rsj"))
    name = f"{first + rng.randrange(1, 4):020d}.rsj"

    def apply(run_dir: Path) -> None:
        target = source.at(run_dir).with_name(name)
        if not target.exists():
            shutil.copyfile(source.at(run_dir), target)

    return Mutation(f"{source} copied as {name}", apply, (name, source.name))
