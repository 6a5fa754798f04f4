"""Which fix a failed Temporal connection gets, from the text temporalio's Rust core gave.

Every text below was captured from temporalio 1.35 (``Client.connect``'s RuntimeError, after
``Failed client connect:``) against the dev server, its TLS terminator of
tests/integration/test_temporal_tls.py, and a blocking ``ssl`` listener that sends its alerts
(as a real TLS server does)."""

from __future__ import annotations

import pickle

import pytest
import typer

from rollsafe.cli.exits import TEMPORAL_FIX, fail
from rollsafe.errors import TemporalUnavailable
from rollsafe.temporal.diagnose import ConnectProblem, diagnose_connect_error

_CONNECT = "Failed client connect: Server connection error: tonic::transport::Error(Transport, "
_AFTER = "Failed client connect: `get_system_info` call error after connection: "

REFUSED = (
    _CONNECT + 'ConnectError(ConnectError("tcp connect error", 127.0.0.1:47073, Os { code: 111, '
    'kind: ConnectionRefused, message: "Connection refused" })))'
)
DNS = (
    _CONNECT + 'ConnectError(ConnectError("dns error", Custom { kind: Uncategorized, error: '
    '"failed to lookup address information: Name or service not known" })))'
)
NO_CA = (
    _CONNECT
    + "ConnectError(Custom { kind: InvalidData, error: InvalidCertificate(UnknownIssuer) }))"
)
WRONG_CA = (
    _CONNECT
    + "ConnectError(Custom { kind: InvalidData, error: InvalidCertificate(BadSignature) }))"
)
WRONG_NAME = (
    _CONNECT + "ConnectError(Custom { kind: InvalidData, error: InvalidCertificate("
    'NotValidForNameContext { expected: DnsName("wrong.example"), presented: '
    '["DnsName(\\"localhost\\")"] }) }))'
)
IP_NO_NAME = (
    _CONNECT + "ConnectError(Custom { kind: InvalidData, error: InvalidCertificate("
    "NotValidForNameContext { expected: IpAddress(V4(Ipv4Addr([127, 0, 0, 1]))), presented: "
    '["DnsName(\\"localhost\\")"] }) }))'
)
EXPIRED = (
    _CONNECT + "ConnectError(Custom { kind: InvalidData, error: InvalidCertificate(ExpiredContext "
    "{ time: UnixTime(1796410424), not_after: UnixTime(1796406824) }) }))"
)
TLS_TO_PLAIN = (
    _CONNECT
    + "ConnectError(Custom { kind: InvalidData, error: InvalidMessage(InvalidContentType) }))"
)
# TLS 1.3, a server that sends its alert (Python's blocking ssl; Go's crypto/tls does too).
ALERT_CERT_REQUIRED = (
    _AFTER + 'Status { code: Unknown, message: "transport error", source: Some(tonic::transport::'
    'Error(Transport, hyper::Error(Io, Custom { kind: InvalidData, error: "received fatal alert: '
    'CertificateRequired" }))) }'
)
ALERT_DECRYPT = (
    _AFTER + 'Status { code: Unknown, message: "transport error", source: Some(tonic::transport::'
    'Error(Transport, hyper::Error(Io, Custom { kind: InvalidData, error: "received fatal alert: '
    'DecryptError" }))) }'
)
# TLS 1.2: the alert comes in the handshake.
ALERT_HANDSHAKE = (
    _CONNECT + "ConnectError(Custom { kind: InvalidData, error: AlertReceived(HandshakeFailure) }))"
)
# TLS 1.3 through asyncio's ssl (the integration test's terminator): no alert, a hang-up.
CLOSED_NO_CERT = (
    _AFTER + 'Status { code: Cancelled, message: "operation was canceled", source: Some(tonic::'
    'transport::Error(Transport, hyper::Error(Canceled, "connection closed"))) }'
)
CLOSED_FOREIGN_CERT = (
    _AFTER + 'Status { code: Unknown, message: "transport error", source: Some(tonic::transport::'
    'Error(Transport, hyper::Error(Io, Custom { kind: UnexpectedEof, error: "peer closed '
    "connection without sending TLS close_notify: https://docs.rs/rustls/latest/rustls/manual/"
    '_03_howto/index.html#unexpected-eof" }))) }'
)
PLAIN_TO_TLS_PIPE = (
    _AFTER + 'Status { code: Unknown, message: "transport error", source: Some(tonic::transport::'
    'Error(Transport, hyper::Error(Io, Custom { kind: BrokenPipe, error: "stream closed because '
    'of a broken pipe" }))) }'
)
PLAIN_TO_TLS_RESET = (
    _AFTER + 'Status { code: Unknown, message: "transport error", source: Some(tonic::transport::'
    "Error(Transport, hyper::Error(Io, Kind(ConnectionReset)))) }"
)


@pytest.mark.parametrize(
    ("text", "tls", "client_cert", "problem", "in_fix"),
    [
        (REFUSED, False, False, ConnectProblem.REFUSED, "start a server"),
        (REFUSED, True, True, ConnectProblem.REFUSED, "start a server"),
        (DNS, False, False, ConnectProblem.UNRESOLVED, "TEMPORAL_ADDRESS"),
        (NO_CA, True, True, ConnectProblem.UNTRUSTED, "TEMPORAL_TLS_SERVER_CA_CERT_PATH"),
        (WRONG_CA, True, False, ConnectProblem.UNTRUSTED, "TEMPORAL_TLS_SERVER_CA_CERT_PATH"),
        (WRONG_NAME, True, True, ConnectProblem.NAME_MISMATCH, "TEMPORAL_TLS_SERVER_NAME"),
        (IP_NO_NAME, True, True, ConnectProblem.NAME_MISMATCH, "TEMPORAL_TLS_SERVER_NAME"),
        (EXPIRED, True, False, ConnectProblem.EXPIRED, "renew the server's certificate"),
        (TLS_TO_PLAIN, True, False, ConnectProblem.SERVER_NOT_TLS, "TEMPORAL_TLS=false"),
        (ALERT_CERT_REQUIRED, True, False, ConnectProblem.CLIENT_CERT_REQUIRED, "CLIENT_CERT"),
        (ALERT_HANDSHAKE, True, False, ConnectProblem.CLIENT_CERT_REQUIRED, "CLIENT_CERT"),
        (ALERT_DECRYPT, True, True, ConnectProblem.CLIENT_CERT_REFUSED, "CLIENT_CERT"),
        (CLOSED_NO_CERT, True, False, ConnectProblem.CLIENT_CERT_REQUIRED, "CLIENT_CERT"),
        (CLOSED_FOREIGN_CERT, True, True, ConnectProblem.CLIENT_CERT_REFUSED, "CLIENT_CERT"),
        (PLAIN_TO_TLS_PIPE, False, False, ConnectProblem.SERVER_WANTS_TLS, "TEMPORAL_TLS=true"),
        (PLAIN_TO_TLS_RESET, False, False, ConnectProblem.SERVER_WANTS_TLS, "TEMPORAL_TLS=true"),
    ],
)
def test_each_captured_failure_gets_its_own_problem_and_fix(
    text: str, tls: bool, client_cert: bool, problem: ConnectProblem, in_fix: str
) -> None:
    found = diagnose_connect_error(text, tls=tls, client_cert=client_cert)
    assert found.problem is problem
    assert in_fix in found.fix
    assert "\n" not in found.cause and "\n" not in found.fix
    # Only a server that is not there gets "start a server".
    assert found.reached is (problem not in (ConnectProblem.REFUSED, ConnectProblem.UNRESOLVED))
    assert ("start a server" in found.fix) is (not found.reached)


def test_a_name_mismatch_names_the_wanted_name_and_those_in_the_certificate() -> None:
    found = diagnose_connect_error(WRONG_NAME, tls=True, client_cert=True)
    assert found.cause == (
        "TLS: the server's certificate is not valid for 'wrong.example' (it names localhost)"
    )
    assert (
        found.fix
        == "set TEMPORAL_TLS_SERVER_NAME to a name in the server's certificate (localhost)"
    )
    by_ip = diagnose_connect_error(IP_NO_NAME, tls=True, client_cert=False)
    assert "not valid for '127.0.0.1' (it names localhost)" in by_ip.cause


def test_the_untrusted_cause_keeps_the_core_term() -> None:
    found = diagnose_connect_error(NO_CA, tls=True, client_cert=False)
    assert found.cause == (
        "TLS: the server's certificate is not signed by a CA this client trusts (UnknownIssuer)"
    )


def test_a_hang_up_means_tls_only_to_a_client_without_it_and_a_cert_only_to_one_with_tls() -> None:
    # The same hang-up: a plain-text client is told to turn TLS on, a TLS one about its cert.
    assert diagnose_connect_error(CLOSED_NO_CERT, tls=False, client_cert=False).problem is (
        ConnectProblem.SERVER_WANTS_TLS
    )
    assert diagnose_connect_error(PLAIN_TO_TLS_PIPE, tls=True, client_cert=True).problem is (
        ConnectProblem.CLIENT_CERT_REFUSED
    )
    # rustls' TLS terms mean nothing to a plain-text client: not recognised, the raw text kept.
    unknown = diagnose_connect_error(NO_CA, tls=False, client_cert=False)
    assert unknown.problem is ConnectProblem.UNKNOWN and unknown.cause == NO_CA


def test_an_unrecognised_failure_keeps_its_text_and_the_start_a_server_fix() -> None:
    text = "Failed client connect: something new"
    found = diagnose_connect_error(text, tls=True, client_cert=False)
    assert (found.problem, found.cause, found.fix) == (ConnectProblem.UNKNOWN, text, TEMPORAL_FIX)


def test_the_cli_line_carries_the_errors_own_fix_and_start_a_server_otherwise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(typer.Exit):
        fail(TemporalUnavailable("cannot connect to X: TLS: bad name", fix="set THAT"))
    assert capsys.readouterr().err == "error: cannot connect to X: TLS: bad name (fix: set THAT)\n"
    with pytest.raises(typer.Exit):
        fail(TemporalUnavailable("cannot reach X: Connection refused"))
    err = capsys.readouterr().err
    assert err == f"error: cannot reach X: Connection refused (fix: {TEMPORAL_FIX})\n"
    assert "start a server (`rollsafe server`)" in err


def test_the_fix_survives_pickling() -> None:
    """Ray carries errors pickled: a TLS fix is not turned back into "start a server"."""
    error = TemporalUnavailable("cannot connect to X: TLS: bad name", fix="set THAT")
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), str(again), again.fix) == (TemporalUnavailable, str(error), "set THAT")
    plain = pickle.loads(pickle.dumps(TemporalUnavailable("cannot reach X")))
    assert plain.fix is None
