"""Every error rollsafe raises, under one base.

::

    RollsafeError
    ├── TransientError                 retry: the same call may succeed later
    │   ├── EnvUnavailable
    │   ├── EnvNotReady
    │   ├── CheckpointTimeout
    │   ├── DataPlaneUnavailable
    │   ├── TemporalUnavailable
    │   └── EngineUnavailable          a generation engine did not answer, or went away
    ├── InvariantError                 never retry: state or input is wrong
    │   ├── OwnershipMismatch
    │   ├── TopologyMismatch
    │   ├── SnapshotCorrupt
    │   │   ├── NoValidSnapshot        no candidate verified; one reason per candidate
    │   │   └── RowMismatch            a restored row differs from what was sealed
    │   ├── SchemaMismatch
    │   ├── LedgerInvariantViolation
    │   │   ├── IllegalTransition      names the rollout/group and both states
    │   │   └── SealConflict           a second seal with different content
    │   ├── UnknownGroup / UnknownRollout
    │   ├── DataPlaneKeyMissing        a read named a key the data plane does not hold
    │   ├── DataPlaneCorrupt           a row read back differs from the digest it was put with
    │   └── PrefixMismatch             a resume's prefix does not belong to the call (names why)
    └── InvalidInput                   malformed user input (scenario file, CLI argument, id)

The trainer SDK (:mod:`rollsafe.client`) adds ``SnapshotsFailed``, ``SupervisorNotRunning``
and ``RestoreFailed`` (invariant); the coordinator (:mod:`rollsafe.checkpoint_state`)
``SnapshotLost``, ``AwaitingRestore`` (a fresh controller of a run with snapshots, until it
restores) and ``AdmissionLeaseExpired`` (transient) and ``CheckpointRefused`` (invalid
input); snapshots on object storage ``ObjectStoreUnavailable`` (transient); the controller
service ``ControllerNotFound`` (transient); fault injection
``InjectedFault`` (transient).

At the Temporal boundary each maps to ``ApplicationError(type=<class name>,
non_retryable=not error.transient)``.
"""

from __future__ import annotations

from collections.abc import Iterable


class RollsafeError(Exception):
    """Base of every rollsafe error."""

    transient: bool = False

    def __reduce__(self) -> tuple[object, ...]:
        # Subclasses take structured arguments but pass one message up; rebuilding from the
        # message keeps class and text intact across pickling (Ray carries errors that way).
        return _rebuild, (type(self), str(self))


def _rebuild(cls: type[RollsafeError], message: str) -> RollsafeError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error


class TransientError(RollsafeError):
    """A failure that may go away: the caller retries."""

    transient = True


class EnvUnavailable(TransientError):
    pass


class EnvNotReady(TransientError):
    pass


class CheckpointTimeout(TransientError):
    pass


class DataPlaneUnavailable(TransientError):
    pass


class TemporalUnavailable(TransientError):
    """The Temporal server did not answer (or a local one failed to start)."""


class EngineUnavailable(TransientError):
    """A generation engine did not answer, was closed, or lost the call's stream."""


class InvariantError(RollsafeError):
    """A failure that retrying cannot fix: the state or the input is wrong."""


class OwnershipMismatch(InvariantError):
    pass


class TopologyMismatch(InvariantError):
    pass


class SnapshotCorrupt(InvariantError):
    """A snapshot (or a file in it) failed verification."""


class NoValidSnapshot(SnapshotCorrupt):
    """No snapshot candidate verified. ``reasons`` maps each candidate to why it was refused."""

    def __init__(self, root: str, reasons: dict[str, str]) -> None:
        self.root = root
        self.reasons = dict(reasons)
        if reasons:
            lines = "".join(f"\n  {name}: {why}" for name, why in sorted(reasons.items()))
            message = f"no valid snapshot under {root}; candidates refused:{lines}"
        else:
            message = f"no snapshot under {root}"
        super().__init__(message)


class RowMismatch(SnapshotCorrupt):
    """A restored row is not the row that was sealed."""

    def __init__(self, group: int, sibling: int, key: str, detail: str) -> None:
        self.group = group
        self.sibling = sibling
        self.key = key
        super().__init__(f"group {group} rollout {sibling} ({key}): {detail}")


class SchemaMismatch(InvariantError):
    pass


class LedgerInvariantViolation(InvariantError):
    pass


class IllegalTransition(LedgerInvariantViolation):
    """An operation asked for a transition the state machine does not allow."""

    def __init__(self, subject: str, operation: str, current: str, target: str) -> None:
        self.subject = subject
        self.operation = operation
        self.current = current
        self.target = target
        super().__init__(f"{subject}: illegal transition {current} -> {target} ({operation})")


class SealConflict(LedgerInvariantViolation):
    pass


class UnknownGroup(InvariantError):
    pass


class UnknownRollout(InvariantError):
    pass


class DataPlaneKeyMissing(InvariantError):
    """A read asked for keys the data plane does not hold; never a silent short read."""

    def __init__(self, partition: str, missing: Iterable[str]) -> None:
        self.partition = partition
        self.missing = sorted(missing)
        shown = ", ".join(self.missing[:10])
        more = f" (+{len(self.missing) - 10} more)" if len(self.missing) > 10 else ""
        super().__init__(f"data plane partition {partition!r} has no row for key(s): {shown}{more}")


class DataPlaneCorrupt(InvariantError):
    """A row read back differs from what was put (its digest, dtype or size): never data."""


class PrefixMismatch(InvariantError):
    """A generation prefix that must not be resumed: tampered, or for another call or prompt.

    Never answered with a silent restart: the caller decides to fall back to the turn."""

    def __init__(self, call_id: str, field: str, detail: str) -> None:
        self.call_id = call_id
        self.field = field
        super().__init__(f"call {call_id}: prefix {field} mismatch: {detail}")


class InvalidInput(RollsafeError, ValueError):
    """Malformed input from a user: a file, an argument, an identifier."""
