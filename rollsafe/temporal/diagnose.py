"""Why a connection to Temporal failed, and what to do about it, from the SDK's error text.

The SDK's Rust core (tonic over rustls) reports every transport failure of ``Client.connect``
as one ``RuntimeError`` whose text is the Rust error's debug form, e.g.::

    Failed client connect: Server connection error: tonic::transport::Error(Transport,
    ConnectError(Custom { kind: InvalidData, error: InvalidCertificate(UnknownIssuer) }))

Only a refused or unresolvable address means "start a server or point TEMPORAL_ADDRESS
elsewhere"; a server that answers but whose TLS does not match the client's settings needs
another setting changed, which :func:`diagnose_connect_error` names. The texts it reads were
captured from temporalio 1.35 against a real TLS listener (tests/unit/test_temporal_diagnose.py
keeps them). Pure: no temporalio import, so the CLI's error path stays cheap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

# The fix for a server that is not there (refused, no such host, or a failure not recognised).
UNREACHABLE_FIX = (
    "start a server (`rollsafe server`) or point TEMPORAL_ADDRESS (and TEMPORAL_NAMESPACE) at yours"
)
CA_FIX = (
    "set TEMPORAL_TLS_SERVER_CA_CERT_PATH (or the profile's tls server_ca_cert_path) to the CA "
    "that signed the server's certificate"
)
EXPIRED_FIX = "renew the server's certificate (or correct this machine's clock if it is wrong)"
NAME_FIX = "set TEMPORAL_TLS_SERVER_NAME to a name in the server's certificate"
CLIENT_CERT_REQUIRED_FIX = (
    "set TEMPORAL_TLS_CLIENT_CERT_PATH and TEMPORAL_TLS_CLIENT_KEY_PATH to a client certificate "
    "and its key, signed by a CA the server trusts"
)
CLIENT_CERT_REFUSED_FIX = (
    "set TEMPORAL_TLS_CLIENT_CERT_PATH / TEMPORAL_TLS_CLIENT_KEY_PATH to a client certificate "
    "signed by a CA the server trusts (and not expired)"
)
NOT_TLS_FIX = (
    "the server speaks plain text: unset TEMPORAL_TLS, the TEMPORAL_TLS_* paths and name (TLS "
    "turns on with any of them, or with TEMPORAL_API_KEY) or set TEMPORAL_TLS=false; or point "
    "TEMPORAL_ADDRESS at the server's TLS port"
)
WANTS_TLS_FIX = (
    "set TEMPORAL_TLS=true (with TEMPORAL_TLS_SERVER_CA_CERT_PATH for a private CA, and "
    "TEMPORAL_TLS_CLIENT_CERT_PATH / TEMPORAL_TLS_CLIENT_KEY_PATH if it wants client certificates)"
)


class ConnectProblem(StrEnum):
    REFUSED = "refused"  # nothing listens at the address
    UNRESOLVED = "unresolved"  # the host name does not resolve
    UNTRUSTED = "untrusted"  # the server's certificate is not signed by a CA the client trusts
    EXPIRED = "expired"  # the server's certificate has expired (or is not valid yet)
    NAME_MISMATCH = "name_mismatch"  # the certificate does not name the server name (SNI)
    CLIENT_CERT_REQUIRED = "client_cert_required"  # mTLS, and no client certificate configured
    CLIENT_CERT_REFUSED = "client_cert_refused"  # mTLS, and the server refused the one given
    SERVER_NOT_TLS = "server_not_tls"  # TLS on, the server answers in plain text
    SERVER_WANTS_TLS = "server_wants_tls"  # TLS off, the server hangs up: it expects TLS
    UNKNOWN = "unknown"


# Problems where the server was reached: only the TLS settings differ.
TLS_PROBLEMS = frozenset(ConnectProblem) - {
    ConnectProblem.REFUSED,
    ConnectProblem.UNRESOLVED,
    ConnectProblem.UNKNOWN,
}


@dataclass(frozen=True)
class ConnectDiagnosis:
    problem: ConnectProblem
    cause: str  # one line: what failed, with the core's own term in parentheses
    fix: str

    @property
    def reached(self) -> bool:
        """The server answered (a TLS mismatch), as opposed to an address with nobody there."""
        return self.problem in TLS_PROBLEMS


# rustls' alerts that mean the server did not accept the client's certificate (or its absence).
_CLIENT_CERT_ALERTS = (
    "CertificateRequired",
    "BadCertificate",
    "UnknownCA",
    "CertificateUnknown",
    "UnsupportedCertificate",
    "CertificateExpired",
    "CertificateRevoked",
    "AccessDenied",
    "DecryptError",  # OpenSSL's answer to a client certificate from a CA it does not know
    "HandshakeFailure",  # TLS 1.2: no client certificate sent when one is required
)
# Transport errors of a connection the server closed after it was made.
_HUNG_UP = (
    "connection closed",
    "UnexpectedEof",
    "close_notify",
    "ConnectionReset",
    "BrokenPipe",
    "broken pipe",
)
_ALERT = re.compile(r"(?:AlertReceived\(|received fatal alert: )(\w+)")
_INVALID_CERT = re.compile(r"InvalidCertificate\((\w+)")
_EXPECTED = re.compile(
    r"expected: (?:DnsName\(\"([^\"]+)\"\)|IpAddress\(V4\(Ipv4Addr\(\[([\d, ]+)\])"
)
_PRESENTED = re.compile(r"DnsName\(\\*\"([^\"\\]+)\\*\"\)")


def diagnose_connect_error(text: str, *, tls: bool, client_cert: bool) -> ConnectDiagnosis:
    """What ``text`` (the SDK's ``RuntimeError`` from ``Client.connect``) means, for a client
    with TLS on or off (``tls``) and with or without a client certificate (``client_cert``)."""
    if "ConnectionRefused" in text or "Connection refused" in text:
        return ConnectDiagnosis(ConnectProblem.REFUSED, "Connection refused", UNREACHABLE_FIX)
    if "dns error" in text:
        return ConnectDiagnosis(
            ConnectProblem.UNRESOLVED, "its host name does not resolve (dns error)", UNREACHABLE_FIX
        )
    if tls:
        found = _tls_problem(text, client_cert)
        if found is not None:
            return found
    elif "after connection" in text and any(sign in text for sign in _HUNG_UP):
        return ConnectDiagnosis(
            ConnectProblem.SERVER_WANTS_TLS,
            "TLS is off and the server hung up at the first call (it expects TLS)",
            WANTS_TLS_FIX,
        )
    return ConnectDiagnosis(ConnectProblem.UNKNOWN, text, UNREACHABLE_FIX)


def _tls_problem(text: str, client_cert: bool) -> ConnectDiagnosis | None:
    if (invalid := _INVALID_CERT.search(text)) is not None:
        kind = invalid.group(1)
        if kind.startswith("NotValidForName"):
            return _name_mismatch(text)
        if kind.startswith(("Expired", "NotValidYet")):
            cause = f"TLS: the server's certificate has expired or is not valid yet ({kind})"
            return ConnectDiagnosis(ConnectProblem.EXPIRED, cause, EXPIRED_FIX)
        cause = f"TLS: the server's certificate is not signed by a CA this client trusts ({kind})"
        return ConnectDiagnosis(ConnectProblem.UNTRUSTED, cause, CA_FIX)
    if "InvalidContentType" in text or "InvalidMessage" in text or "CorruptMessage" in text:
        return ConnectDiagnosis(
            ConnectProblem.SERVER_NOT_TLS,
            "TLS is on but the server did not answer in TLS (InvalidContentType)",
            NOT_TLS_FIX,
        )
    alert = _ALERT.search(text)
    if alert is not None and alert.group(1) in _CLIENT_CERT_ALERTS:
        said = f"the server sent alert {alert.group(1)}"
    elif alert is None and "after connection" in text and any(s in text for s in _HUNG_UP):
        # A TLS 1.3 server checks the client certificate after the client's handshake is done:
        # a server that does not send its alert just closes the connection at the first call.
        said = "the server closed the connection after the handshake"
    else:
        return None
    if client_cert:
        cause = f"TLS: the server refused the client certificate ({said})"
        return ConnectDiagnosis(ConnectProblem.CLIENT_CERT_REFUSED, cause, CLIENT_CERT_REFUSED_FIX)
    cause = f"TLS: the server requires a client certificate and none is configured ({said})"
    return ConnectDiagnosis(ConnectProblem.CLIENT_CERT_REQUIRED, cause, CLIENT_CERT_REQUIRED_FIX)


def _name_mismatch(text: str) -> ConnectDiagnosis:
    expected = _EXPECTED.search(text)
    if expected is None:  # an IPv6 address, or a form this does not know
        wanted = "the server name or address"
    elif expected.group(1) is not None:
        wanted = repr(expected.group(1))
    else:
        wanted = repr(".".join(part.strip() for part in expected.group(2).split(",")))
    _, _, presented = text.partition("presented:")
    names = list(dict.fromkeys(_PRESENTED.findall(presented)))
    has = f" (it names {', '.join(names)})" if names else ""
    cause = f"TLS: the server's certificate is not valid for {wanted}{has}"
    fix = NAME_FIX + (f" ({', '.join(names)})" if names else "")
    return ConnectDiagnosis(ConnectProblem.NAME_MISMATCH, cause, fix)
