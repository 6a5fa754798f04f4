"""The versions rollsafe's processes speak to each other with, and the skew that works
(docs/upgrading.md).

A *release* is the package's version (``rollsafe.__version__``). The *contract* is one integer
for every process-to-process shape of a release: the worker's calls to the run's controller
actor (Ray), the workflows' payloads (Temporal), the models both carry. A release that changes
any of them takes the next contract number. Contract 1 is every release before contracts were
named (0.1.x): its processes carry no version, and a peer that names none is taken for it.

Peers at most one contract apart work together, in either direction (a rolling upgrade, or a
rollback of one release); any other pair is refused at first contact with
:class:`~rollsafe.errors.VersionSkew` naming both sides. What makes one release of skew work:

- a release adds fields, never removes or retypes one, and writes a field it added only when
  it is not at its default (:class:`~rollsafe.core.wire.Evolving`), so the release before,
  whose models forbid unknown fields, reads what it writes whenever the new field is unused;
- a reader drops the unknown fields of a payload written by the next contract, and only
  those (``rollsafe.temporal.converter``);
- the controller keeps the calls of the contract before (their names, arguments, results).

The file formats (snapshot manifests, ledger, loader, journal, environment records, engine
prefixes) carry their own format numbers, checked when read; a format that gains a field
takes the next number (tests/unit/test_format_versions.py keeps each number's fields).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rollsafe import __version__
from rollsafe.errors import VersionSkew

CONTRACT = 2
UNVERSIONED = 1  # a peer that names no contract: a release before contracts (0.1.x)
SKEW = 1  # contracts apart that still work together


class Peer(BaseModel):
    """What a process says of itself at first contact."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # a later release may say more

    release: str
    contract: int = Field(ge=1)


THIS = Peer(release=__version__, contract=CONTRACT)


def supported(contract: int) -> bool:
    return abs(contract - CONTRACT) <= SKEW


def skew(what: str, peer: Peer) -> str | None:
    """Why ``what`` (e.g. "the controller actor of run 'r'") cannot work with this process,
    in one line naming both sides and what to do; None when it can."""
    if supported(peer.contract):
        return None
    older = "it" if peer.contract < CONTRACT else "this process"
    return (
        f"{what} is rollsafe {peer.release} (contract {peer.contract}); this process is "
        f"rollsafe {THIS.release} (contract {CONTRACT}), which works with contracts "
        f"{CONTRACT - SKEW} to {CONTRACT + SKEW}: upgrade {older} to a release at most one "
        "apart (docs/upgrading.md)"
    )


def check_peer(what: str, peer: Peer) -> None:
    """:func:`skew` as :class:`~rollsafe.errors.VersionSkew`."""
    message = skew(what, peer)
    if message is not None:
        raise VersionSkew(message)


def unversioned_peer() -> Peer:
    return Peer(release="0.1.x (before contracts)", contract=UNVERSIONED)
