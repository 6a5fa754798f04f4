"""``rollsafe doctor``'s findings, and the checks that need no Temporal: Ray and the snapshot
store's disk or bucket. The Temporal checks are in :mod:`rollsafe.cli.doctor.temporal`.

Every check returns one :class:`DoctorCheck` and never raises: a deployment problem is a
finding, named with the command or setting that fixes it.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import platform
import shutil
import socket
import threading
from enum import StrEnum
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from rollsafe.errors import InvalidInput
from rollsafe.snapshot import _fs
from rollsafe.snapshot import _objects as objects
from rollsafe.snapshot.bounded import read_regular
from rollsafe.snapshot.location import parse_location

RAY = "Ray reachable"
STORAGE = "snapshot storage"
_GIB = 1 << 30
_PROBE_BYTES = b"rollsafe doctor probe\n"
DOCTOR_PREFIX = ".rollsafe-doctor"  # object storage: probe objects live (briefly) under it


class Status(StrEnum):
    OK = "ok"
    FAILED = "FAILED"
    SKIPPED = "skipped"  # not configured, or not allowed to look: never fails the run


class DoctorCheck(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    status: Status
    detail: str
    fix: str = ""


def ok(name: str, detail: str) -> DoctorCheck:
    return DoctorCheck(name=name, status=Status.OK, detail=detail)


def failed(name: str, detail: str, fix: str) -> DoctorCheck:
    return DoctorCheck(name=name, status=Status.FAILED, detail=detail, fix=fix)


def skipped(name: str, detail: str, fix: str = "") -> DoctorCheck:
    return DoctorCheck(name=name, status=Status.SKIPPED, detail=detail, fix=fix)


# -- Ray -------------------------------------------------------------------------------------


def parse_ray_address(address: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of a Ray address: ``host:port`` (the head's GCS, scheme
    ``gcs``) or ``ray://host:port`` (Ray Client). InvalidInput for anything else."""
    scheme, sep, rest = address.strip().rpartition("://")
    scheme = scheme if sep else "gcs"
    if scheme not in ("gcs", "ray"):
        raise InvalidInput(f"Ray address {address!r}: scheme {scheme!r} is not ray://")
    host, sep, port = rest.rstrip("/").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:6379
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(f"Ray address {address!r} is not host:port or ray://host:port")
    return scheme, host, int(port)


def _ray_fix(where: str) -> str:
    return (
        f"start the Ray head {where} (`ray start --head --port=PORT`), or set RAY_ADDRESS / "
        "--ray-address to the head's GCS address (host:6379, as `ray start` printed it)"
    )


RAY_CLIENT_PORT = 10001  # the port `ray start --head` gives its Ray Client server by default


def ray_client_fix(host: str, port: int) -> str:
    """What to do when Ray Client (``ray://host:port``) cannot join: the port must be the
    head's Ray Client server, and Ray Client needs this machine's Python (major.minor) and Ray
    versions to be the head's."""
    try:
        ray_version = version("ray")
    except PackageNotFoundError:
        ray_version = "not installed"
    return (
        f"start the Ray head with its Ray Client server on {host}:{port} (`ray start --head "
        f"--ray-client-server-port={port}`; the default port is {RAY_CLIENT_PORT}) and run the "
        "head's Python and Ray versions here (Ray Client needs both to match; this machine has "
        f"Python {platform.python_version()}, Ray {ray_version}), or set RAY_ADDRESS / "
        "--ray-address to the head's GCS address (host:6379) from a machine of the cluster"
    )


def ray_error_cause(text: str) -> str:
    """Ray's error text as one line: a traceback it carries (Ray Client's ``Initialization
    failure from server:`` holds the server's) reduced to its last line, the exception; lines
    joined; and Ray's advice about its own ``--address`` flag, which rollsafe lacks, dropped."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback (")), None)
    if start is not None:
        lines = [*lines[:start], lines[-1]]
    cause = " ".join(lines)
    kept = [sentence for sentence in cause.split(". ") if "--address" not in sentence]
    return ". ".join(kept) or cause or "no message"


def check_ray(address: str | None, timeout_s: float, *, count_nodes: bool = True) -> DoctorCheck:
    """A TCP connect to the cluster (no ``ray.init``: the doctor joins nothing), then, for a
    GCS address and ``count_nodes``, the number of alive nodes from the GCS itself (a process
    about to ``ray.init`` passes False: it needs the connect only, and no GCS client of its own
    beside Ray's)."""
    if not address:
        return skipped(RAY, "no --ray-address or RAY_ADDRESS: workers use the local cluster")
    if address.strip() == "local":
        return skipped(RAY, "RAY_ADDRESS=local: each process starts a cluster of its own")
    among = ""
    if address.strip() == "auto":
        resolved, running = _local_ray_clusters()
        if resolved is None:
            return failed(
                RAY, f"{address!r}: no Ray cluster on this machine", _ray_fix("on this machine")
            )
        address = resolved
        among = _auto_among(resolved, running)
    try:
        scheme, host, port = parse_ray_address(address)
    except InvalidInput as exc:
        return failed(RAY, str(exc), "set RAY_ADDRESS / --ray-address to host:port")
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__  # a timeout has no strerror
        if scheme == "ray":
            detail, fix = f"cannot reach Ray Client at {host}:{port}", ray_client_fix(host, port)
        else:
            detail, fix = f"cannot reach Ray at {host}:{port}", _ray_fix(f"at {host}:{port}")
        return failed(RAY, f"{detail}: {why}", fix)
    if scheme == "ray":  # a Ray Client server: its port answers, nothing more to ask cheaply
        return ok(RAY, f"Ray Client at {host}:{port} accepts connections")
    if not count_nodes:
        return ok(RAY, f"GCS at {host}:{port} accepts connections{among}")
    nodes = _node_count(address, timeout_s)
    return ok(RAY, f"GCS at {host}:{port} accepts connections; {nodes}{among}")


def _local_ray_clusters() -> tuple[str | None, list[str]]:
    """The cluster ``ray.init(address="auto")`` (a worker without an address) would join,
    found by Ray's own lookup (the last ``ray start`` under the default temp dir, else any
    running GCS), and the GCS addresses of every cluster running on this machine."""
    try:
        services = importlib.import_module("ray._private.services")
        running = sorted(services.find_gcs_addresses())
        found: str | None = services.get_ray_address_from_environment("auto", None)
    except Exception:  # private API: its absence only loses this lookup
        return None, []
    return found, running


def _auto_among(resolved: str, running: list[str]) -> str:
    """What a shared host adds to the Ray row: ``auto`` picks one of several clusters."""
    others = [address for address in running if address != resolved]
    if not others:
        return ""
    return (
        f"; 'auto' joins {resolved} but {len(running)} Ray clusters run on this machine "
        f"(also {', '.join(others)}): set RAY_ADDRESS to the run's own (docs/deploy.md, "
        "'Which Ray cluster')"
    )


def _node_count(address: str, timeout_s: float) -> str:
    """The alive node count from the GCS, or why not. Ray's own GCS client, standalone: one RPC,
    no driver, nothing joins the cluster. It is a private API whose waits do not all honour
    the timeout (~12 s when the port is not a GCS), so it runs in a daemon thread that is
    abandoned after ``timeout_s``; any failure only loses the count."""
    answer: list[str] = []
    thread = threading.Thread(
        target=lambda: answer.append(_ask_gcs(address, timeout_s)), daemon=True
    )
    thread.start()
    thread.join(timeout_s)
    if not answer:
        return f"node count unavailable (no GCS answer within {timeout_s:g} s: is it the GCS port?)"
    return answer[0]


def _ask_gcs(address: str, timeout_s: float) -> str:
    try:
        raylet: Any = importlib.import_module("ray._raylet")
        gcs = raylet.InnerGcsClient.standalone(address, None, int(timeout_s * 1000))
        nodes = gcs.get_all_node_info(timeout=timeout_s)
        alive_state = importlib.import_module("ray.core.generated.gcs_pb2").GcsNodeInfo.ALIVE
    except Exception as exc:
        return f"node count unavailable ({type(exc).__name__}: {exc})"
    alive = sum(1 for info in nodes.values() if info.state == alive_state)
    return f"{alive} alive node(s) of {len(nodes)} known"


# -- snapshot storage ------------------------------------------------------------------------


def storage_fix(path: Path, error: OSError) -> str:
    """What to do about ``error``, raised while probing snapshot root ``path``."""
    code = error.errno
    if code in (errno.EACCES, errno.EPERM):
        return (
            f"give the user that runs rollsafe (uid {os.geteuid()}) write access to {path} "
            "(chown / chmod), or choose another --snapshot-root"
        )
    if code == errno.EROFS:
        return f"{path} is on a read-only filesystem: remount it read-write, or choose another root"
    if code in (errno.ENOTDIR, errno.EEXIST):
        return f"{path} or one of its parents is a file, not a directory: choose another root"
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"the filesystem of {path} is full (or over quota): free space there"
    if code == errno.ENOLCK:
        return f"{path} is on a filesystem without file locks (flock): mount it with locking"
    return f"check that {path} is a writable local or network filesystem (permissions, mount)"


def check_storage(
    location: Path | str | None,
    timeout_s: float | None = None,
    storage_options: dict[str, Any] | None = None,
) -> DoctorCheck:
    """The primitives the snapshot store publishes with. A directory (or file:// URL): tried
    in a probe directory under it and removed again: create the root, flock a directory,
    write + fsync + read back, rename a directory (a draft's commit point), replace a file
    atomically (``LATEST``). Object storage: :func:`check_object_storage`, each call bounded
    by ``timeout_s`` (None: the store's own limit)."""
    if location is None:
        return skipped(STORAGE, "no --snapshot-root or ROLLSAFE_SNAPSHOT_ROOT given")
    where = parse_location(location)
    if isinstance(where, str):
        return check_object_storage(where, timeout_s, storage_options)
    root = where.expanduser().absolute()
    created = _missing_dirs(root)
    try:
        _fs.make_dirs_durable(root)
        excluded = _probe(root)
        usage = shutil.disk_usage(root)
    except OSError as exc:
        where = exc.filename or root
        return failed(STORAGE, f"{where}: {exc.strerror or exc}", storage_fix(root, exc))
    finally:
        _remove_dirs(created)
    if not excluded:
        return failed(
            STORAGE,
            f"{root}: a second flock on a locked directory was granted",
            f"{root} does not honour flock (concurrent publishers could collide): mount it "
            "with working locks or choose another root",
        )
    made = " (did not exist: created and removed again)" if created else ""
    free = f"{usage.free / _GIB:.1f} GiB free of {usage.total / _GIB:.1f} GiB"
    return ok(STORAGE, f"{root}{made}: flock, write + fsync, rename, atomic replace ok; {free}")


def check_object_storage(
    url: str, timeout_s: float | None = None, storage_options: dict[str, Any] | None = None
) -> DoctorCheck:
    """What publishing to object storage relies on, tried on one probe object under
    ``<url>/.rollsafe-doctor/`` and deleted again: a conditional create, read back, listed,
    a second conditional create of the same key refused (the property that lets exactly one
    publisher commit a seq's manifest and ``LATEST`` pointer), delete. Credentials and the
    endpoint come from the environment, as for the store (AWS_*, GOOGLE_*)."""
    try:
        fs, base = objects.open_filesystem(url, storage_options)
    except InvalidInput as exc:
        return failed(
            STORAGE,
            str(exc),
            "use s3://bucket/prefix, gs://bucket/prefix or a directory, with "
            "`pip install 'rollsafe[object-storage]'` on every machine that runs the controller",
        )
    folder = f"{base}/{DOCTOR_PREFIX}"
    probe = f"{folder}/probe-{_fs.token()}"
    step, created = "create of a probe object", False
    try:
        created = objects.create_exclusive(fs, probe, _PROBE_BYTES, timeout_s=timeout_s)
        step = "read back"
        if objects.read_object(fs, probe, timeout_s=timeout_s) != _PROBE_BYTES:
            return failed(
                STORAGE,
                f"{url}: {probe} read back differs from what was written",
                "check the endpoint: a proxy or cache in front of the store?",
            )
        step = "listing"
        if probe.rsplit("/", 1)[-1] not in objects.list_names(fs, folder, timeout_s=timeout_s):
            return failed(
                STORAGE,
                f"{url}: {probe} was written but is not listed under {folder}",
                "grant list permission on the prefix (s3:ListBucket); listings must be "
                "consistent with writes",
            )
        step = "conditional create of an existing object"
        refused = not objects.create_exclusive(fs, probe, b"second\n", timeout_s=timeout_s)
        step = "delete"
        objects.remove_objects(fs, [probe], timeout_s=timeout_s)
        created = False
    except objects.ObjectStoreUnavailable as exc:
        return failed(STORAGE, f"{url}: {step} failed: {exc}", _object_fix(url, base, exc))
    finally:
        if created:  # a check failed part-way: leave nothing behind if the store lets us
            _remove_quietly(fs, probe, timeout_s)
    if not refused:
        return failed(
            STORAGE,
            f"{url}: a conditional create (If-None-Match: *) of an existing object was "
            "accepted and overwrote it",
            "publishing needs conditional writes, else two publishers of one seq can both "
            "commit: use AWS S3, GCS or an S3-compatible server that answers 412 to "
            "If-None-Match: * (check its version), or a shared directory",
        )
    return ok(
        STORAGE,
        f"{url}: conditional create, read back, list, second create refused, delete ok "
        f"(under {DOCTOR_PREFIX}/)",
    )


def _remove_quietly(fs: Any, path: str, timeout_s: float | None) -> None:
    # The finding already names the first problem; this one would only hide it.
    with contextlib.suppress(objects.ObjectStoreUnavailable):
        objects.remove_objects(fs, [path], timeout_s=timeout_s)


def _object_fix(url: str, base: str, error: objects.ObjectStoreUnavailable) -> str:
    cause = error.__cause__
    bucket = base.split("/", 1)[0]
    if isinstance(cause, FileNotFoundError):
        return (
            f"bucket {bucket!r} does not exist (or the endpoint is another service's): "
            f"create it, or correct the URL {url}"
        )
    if isinstance(cause, PermissionError):
        return (
            f"the credentials in use may not write under {url}: grant list, get, put and "
            "delete on the prefix (s3:ListBucket, s3:GetObject, s3:PutObject, "
            "s3:DeleteObject), or set the right AWS_* / GOOGLE_APPLICATION_CREDENTIALS"
        )
    return (
        "check the endpoint (AWS_ENDPOINT_URL for an S3-compatible server), the network to "
        "it and the credentials (AWS_* variables, profile or role; Google ADC)"
    )


def _probe(root: Path) -> bool:
    """Run the store's primitives under ``root``; True when a held flock excludes others."""
    probe = root / f".rollsafe-doctor-{_fs.token()}"
    probe.mkdir()
    try:
        draft = probe / f"{_fs.TEMP_PREFIX}draft"
        draft.mkdir()
        fd = _fs.open_dir(draft)
        try:
            other = _fs.open_dir(draft)
            try:
                locked = _fs.try_lock(fd)
                excluded = locked and not _fs.try_lock(other)
            finally:
                os.close(other)
            _write_synced(draft / "data", _PROBE_BYTES)
            final = probe / "published"
            os.rename(draft, final)  # the publish commit point: a directory rename
            _fs.fsync_dir(probe)
        finally:
            os.close(fd)
        if read_regular(final / "data") != _PROBE_BYTES:
            raise OSError(errno.EIO, "read back differs from what was written", str(final))
        latest = probe / _fs.LATEST_NAME
        _fs.write_atomic(latest, b"old\n")
        _fs.write_atomic(latest, _PROBE_BYTES)  # replaces an existing file, as LATEST does
        if read_regular(latest) != _PROBE_BYTES:
            raise OSError(errno.EIO, "atomic replace read back the old content", str(latest))
    finally:
        _fs.remove_tree(probe)
    return excluded


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _missing_dirs(path: Path) -> list[Path]:
    """The directories ``mkdir -p path`` would create, outermost first."""
    missing = []
    current = path
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    return list(reversed(missing))


def _remove_dirs(created: list[Path]) -> None:
    # The doctor leaves nothing behind; only directories it created, and only if still empty.
    for directory in reversed(created):
        try:
            directory.rmdir()
        except OSError:
            return
