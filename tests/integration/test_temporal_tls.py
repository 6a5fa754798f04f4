"""TLS to Temporal (issue 22, part 8): a snapshot workflow runs end to end over mutual TLS,
and a client without the server's CA or without a client certificate is refused, naming the
address.

The embedded dev server has no TLS options (``temporal server start-dev --help``, CLI 1.9.1),
so the session's dev server is put behind a TLS terminator here: Python's ``ssl`` with ALPN
``h2`` (gRPC's), a certificate for ``localhost`` signed by a CA made for the test, client
certificates required, each connection piped to the server's plaintext port. The client side
is rollsafe's own (``ConnectionSettings`` with the ``tls_*`` paths, the SDK's TLS); a Temporal
cluster's frontend terminates TLS itself, the same way for the client."""

from __future__ import annotations

import asyncio
import datetime
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from typer.testing import CliRunner

from rollsafe.checkpoint.controller import Controller
from rollsafe.cli.app import app
from rollsafe.cli.doctor import DoctorReport
from rollsafe.cli.exits import TEMPORAL_FIX
from rollsafe.client import Checkpointer
from rollsafe.dataplane import make_dataplane
from rollsafe.errors import TemporalUnavailable
from rollsafe.evidence.scenario import busy_run
from rollsafe.snapshot import SnapshotStore
from rollsafe.temporal.connect import ConnectionSettings, connect
from rollsafe.workflows.models import PhaseOptions

pytestmark = pytest.mark.timeout(180)

RUN = "tls"
FAST = PhaseOptions(retry_initial_s=0.05, retry_maximum_s=0.5, retry_attempts=5, task_timeout_s=2.0)


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
    *,
    usage: x509.ObjectIdentifier | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, signer = issuer if issuer is not None else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if usage == ExtendedKeyUsageOID.SERVER_AUTH:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False
        )
    return builder.sign(signer, hashes.SHA256())


def make_certificates(where: Path) -> Certificates:
    """A CA, a server certificate for ``localhost`` and a client certificate it signed."""
    where.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("rollsafe test CA", ca_key, None)
    paths = {"ca": where / "ca.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for role, usage in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(f"rollsafe test {role}", key, ("rollsafe test CA", ca_key), usage=usage)
        paths[f"{role}_cert"] = where / f"{role}.pem"
        paths[f"{role}_key"] = where / f"{role}-key.pem"
        paths[f"{role}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{role}_key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return Certificates(**paths)


class TlsTerminator:
    """Accepts TLS (client certificates required, ALPN h2) on 127.0.0.1 and pipes each
    connection to ``backend`` in the clear; counts the handshakes that completed."""

    def __init__(self, backend: str, certs: Certificates) -> None:
        self.backend_host, _, port = backend.rpartition(":")
        self.backend_port = int(port)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(certs.server_cert, certs.server_key)
        self.context.load_verify_locations(certs.ca)
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.context.set_alpn_protocols(["h2"])
        self.handshakes = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tls", daemon=True)
        self.server: asyncio.Server | None = None

    def __enter__(self) -> str:
        self.thread.start()
        started = asyncio.run_coroutine_threadsafe(self._start(), self.loop)
        self.server = started.result(timeout=10)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._pipe, "127.0.0.1", 0, ssl=self.context)

    async def _stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handshakes += 1
        up_reader, up_writer = await asyncio.open_connection(self.backend_host, self.backend_port)

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while chunk := await src.read(65536):
                    dst.write(chunk)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))


@pytest.fixture
def tls(server: Any, tmp_path: Path) -> Iterator[tuple[str, Certificates, TlsTerminator]]:
    certs = make_certificates(tmp_path / "certs")
    terminator = TlsTerminator(server.address, certs)
    with terminator as address:
        yield address, certs, terminator


async def test_a_snapshot_runs_over_mutual_tls_and_a_client_without_the_ca_or_a_cert_is_refused(
    server: Any, tls: tuple[str, Certificates, TlsTerminator], tmp_path: Path
) -> None:
    address, certs, terminator = tls
    settings = ConnectionSettings(
        address=address,
        namespace=server.namespace,
        tls_server_ca_cert_path=certs.ca,
        tls_server_name="localhost",
        tls_client_cert_path=certs.client_cert,
        tls_client_key_path=certs.client_key,
    )
    client = await connect(settings)
    store = SnapshotStore(tmp_path / "snapshots", RUN)
    controller = Controller.from_parts(busy_run(RUN, make_dataplane("memory")), store)
    ckpt = Checkpointer(RUN, client=client, options=FAST, interval_s=3600)
    async with ckpt.worker(controller):  # the worker polls over the same TLS connection
        await ckpt.start()
        outcome = await asyncio.wait_for(ckpt.snapshot_now(), 120)
        await ckpt.stop(wait=True, timeout=60)
    assert outcome.status == "published", outcome
    assert store.select().manifest.checkpoint_id == outcome.checkpoint_id
    assert terminator.handshakes >= 1

    no_ca = settings.model_copy(update={"tls_server_ca_cert_path": None})
    no_cert = settings.model_copy(
        update={"tls_client_cert_path": None, "tls_client_key_path": None}
    )
    plaintext = settings.model_copy(update={"tls": False})
    for refused in (no_ca, no_cert, plaintext):
        with pytest.raises(TemporalUnavailable, match=address):
            await connect(refused, timeout_s=5)


# -- the CLI's one line for each TLS mismatch: what failed and the setting to change ------------


TLS_VARIABLES = (
    "TEMPORAL_TLS",
    "TEMPORAL_TLS_SERVER_CA_CERT_PATH",
    "TEMPORAL_TLS_SERVER_NAME",
    "TEMPORAL_TLS_CLIENT_CERT_PATH",
    "TEMPORAL_TLS_CLIENT_KEY_PATH",
    "TEMPORAL_API_KEY",
)


def inspect_with(address: str, namespace: str, variables: dict[str, str | None]) -> Any:
    """``rollsafe inspect`` with exactly these TLS variables (no profile, no settings file)."""
    env: dict[str, str | None] = {
        "TEMPORAL_ADDRESS": address,
        "TEMPORAL_NAMESPACE": namespace,
        "TEMPORAL_CONFIG_FILE": "/nonexistent/temporal.toml",  # no user profile leaks in
        "TEMPORAL_PROFILE": None,
        "ROLLSAFE_CONFIG": None,
        **dict.fromkeys(TLS_VARIABLES),
        **variables,
    }
    return CliRunner().invoke(app, ["inspect", "tls-probe"], env=env)


def test_each_tls_mismatch_is_one_line_naming_the_setting_to_change(
    server: Any, tls: tuple[str, Certificates, TlsTerminator], tmp_path: Path
) -> None:
    address, certs, _terminator = tls
    good: dict[str, str | None] = {
        "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(certs.ca),
        "TEMPORAL_TLS_SERVER_NAME": "localhost",
        "TEMPORAL_TLS_CLIENT_CERT_PATH": str(certs.client_cert),
        "TEMPORAL_TLS_CLIENT_KEY_PATH": str(certs.client_key),
    }
    at = f"Temporal server at {address} (namespace {server.namespace!r})"
    cases = {
        "wrong server name": (
            {**good, "TEMPORAL_TLS_SERVER_NAME": "wrong.example"},
            f"cannot connect to {at}: TLS: the server's certificate is not valid for "
            "'wrong.example' (it names localhost)",
            "set TEMPORAL_TLS_SERVER_NAME to a name in the server's certificate (localhost)",
        ),
        "no CA": (
            {**good, "TEMPORAL_TLS_SERVER_CA_CERT_PATH": None},
            f"cannot connect to {at}: TLS: the server's certificate is not signed by a CA this "
            "client trusts (UnknownIssuer)",
            "set TEMPORAL_TLS_SERVER_CA_CERT_PATH (or the profile's tls server_ca_cert_path) "
            "to the CA that signed the server's certificate",
        ),
        "no client certificate": (
            {**good, "TEMPORAL_TLS_CLIENT_CERT_PATH": None, "TEMPORAL_TLS_CLIENT_KEY_PATH": None},
            f"cannot connect to {at}: TLS: the server requires a client certificate and none "
            "is configured (the server closed the connection after the handshake)",
            "set TEMPORAL_TLS_CLIENT_CERT_PATH and TEMPORAL_TLS_CLIENT_KEY_PATH to a client "
            "certificate and its key, signed by a CA the server trusts",
        ),
        "plain text against TLS": (
            {**good, "TEMPORAL_TLS": "false"},
            f"cannot connect to {at}: TLS is off and the server hung up at the first call "
            "(it expects TLS)",
            "set TEMPORAL_TLS=true",
        ),
    }
    for name, (variables, what, fix) in cases.items():
        result = inspect_with(address, server.namespace, variables)
        assert result.exit_code == 1, (name, result.output)
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"error: {what} (fix: {fix}"), (name, line)
        assert "start a server" not in line and "tonic" not in line, (name, line)

    # TLS against the dev server's own plain-text port.
    plain = inspect_with(server.address, server.namespace, good)
    assert plain.exit_code == 1, plain.output
    (line,) = plain.stderr.strip().splitlines()
    assert line.startswith(
        f"error: cannot connect to Temporal server at {server.address} (namespace "
        f"{server.namespace!r}): TLS is on but the server did not answer in TLS "
        "(InvalidContentType) (fix: the server speaks plain text: unset TEMPORAL_TLS"
    ), line

    # Nobody there: still "start a server".
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = f"127.0.0.1:{probe.getsockname()[1]}"
    nobody = inspect_with(free, server.namespace, good)
    assert nobody.exit_code == 1, nobody.output
    (line,) = nobody.stderr.strip().splitlines()
    assert line == (
        f"error: cannot reach Temporal server at {free} (namespace {server.namespace!r}): "
        f"Connection refused (fix: {TEMPORAL_FIX})"
    )

    # `rollsafe doctor` gives its "Temporal reachable" row the same fix.
    env = {
        "TEMPORAL_ADDRESS": address,
        "TEMPORAL_NAMESPACE": server.namespace,
        "TEMPORAL_CONFIG_FILE": "/nonexistent/temporal.toml",
        "TEMPORAL_PROFILE": None,
        "ROLLSAFE_CONFIG": None,
        "RAY_ADDRESS": None,
        **dict.fromkeys(TLS_VARIABLES),
        **good,
        "TEMPORAL_TLS_SERVER_NAME": "wrong.example",
    }
    args = ["doctor", "--json", "--snapshot-root", str(tmp_path)]
    doctor = CliRunner().invoke(app, args, env=env)
    assert doctor.exit_code == 1, doctor.output
    report = DoctorReport.model_validate_json(doctor.stdout)
    (reach,) = (check for check in report.checks if check.name == "Temporal reachable")
    assert "not valid for 'wrong.example' (it names localhost)" in reach.detail
    assert reach.fix == (
        "set TEMPORAL_TLS_SERVER_NAME to a name in the server's certificate (localhost)"
    )
