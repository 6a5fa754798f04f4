"""Every error rollsafe raises, under one base, in this one module.

::

    RollsafeError
    ├── TransientError                 retry: the same call may succeed later
    │   ├── EnvUnavailable             an environment instance did not answer
    │   ├── EnvNotReady                an environment instance cannot take the call yet
    │   │   └── EpisodeParked          409 checkpoint_parked: re-send the same run once idle
    │   ├── CheckpointTimeout          a snapshot or restore did not end in time
    │   ├── DataPlaneUnavailable
    │   ├── TemporalUnavailable
    │   │   └── PortTaken              a local dev server's port was taken before it bound it
    │   ├── EngineUnavailable          a generation engine did not answer, or went away
    │   ├── ControllerUnavailable      no controller for the run can be reached (yet)
    │   ├── ObjectStoreUnavailable     object storage failed in a way that may pass
    │   ├── SnapshotLost               this checkpoint's draft is gone: take the snapshot again
    │   ├── StorageFailed              the snapshot store's disk refused a write (full, read-only)
    │   ├── AwaitingRestore            a fresh controller of a run with snapshots, until it restores
    │   ├── AdmissionLeaseExpired      the park outlived its lease: the snapshot is abandoned
    │   ├── AdmissionClosed            a dispatch waited past its timeout while a snapshot parked
    │   ├── CheckpointSpent            this checkpoint id can no longer park the environments
    │   ├── CheckpointBusy             another checkpoint's draft is open: open again later
    │   └── InjectedFault              an armed fault point, action ``raise``
    ├── InvariantError                 never retry: state or input is wrong
    │   ├── OwnershipMismatch
    │   ├── TopologyMismatch
    │   ├── SnapshotCorrupt
    │   │   ├── ContentMismatch        a file's bytes are not those the manifest lists
    │   │   ├── NoValidSnapshot        no candidate verified; one reason per candidate
    │   │   └── RowMismatch            a restored row differs from what was sealed
    │   ├── SchemaMismatch
    │   ├── VersionSkew                peers (or a file) of releases too far apart: names both
    │   ├── JournalCorrupt             a journal segment that is not one, or not this run's
    │   │   └── JournalGap             the journal does not continue the snapshot (names what)
    │   ├── JournalFailed              its disk refused or stalled a write: restart once fixed
    │   ├── LedgerInvariantViolation
    │   │   ├── IllegalTransition      names the rollout/group and both states
    │   │   └── SealConflict           a second seal with different content
    │   ├── UnknownGroup
    │   ├── UnknownRollout
    │   ├── DataPlaneKeyMissing        a read named a key the data plane does not hold
    │   ├── DataPlaneCorrupt           a row read back differs from the digest it was put with
    │   ├── PrefixMismatch             a resume's prefix does not belong to the call (names why)
    │   ├── ReplayDiverged             a replayed session's call differs from its record (names it)
    │   ├── EffectDiverged             asked again with other arguments than it was applied with
    │   ├── SnapshotsFailed            the SDK: the run's supervisor failed
    │   ├── RestoreFailed              the SDK: the run could not be restored
    │   ├── CheckpointMismatch         a trainer checkpoint that is not this run's (names why)
    │   ├── SupervisorNotRunning       the SDK: no supervisor runs for the run
    │   └── InjectedInvariantFault     an armed fault point, action ``invariant``
    ├── InvalidInput                   malformed user input (scenario file, CLI argument, id)
    │   ├── AnchorPassed               an anchored snapshot found another weight version: skipped
    │   ├── PhaseConflict              a phase that conflicts with its checkpoint's or another's
    │   │   ├── CheckpointRefused      a phase this checkpoint may not run (aborted, resumed, ...)
    │   │   └── GateHeld               another checkpoint holds admission closed
    │   ├── EvidenceError              an evidence file is malformed
    │   ├── ScenarioError              a scenario file is malformed, or an event cannot happen
    │   ├── ParticipantRefused         an environment participant's 409, raised on its side
    │   ├── RunNotFound                no workflow or worker of the run on the Temporal server
    │   └── EnvRefused                 an environment's 409 seen by its client, not retryable
    ├── EnvRefusal                     base of EpisodeParked and EnvRefused: the instance's 409
    ├── ServerDidNotStart              a rollsafe server process did not come up
    └── ExtraNotInstalled              a part needs an optional extra: names the pip install

``EpisodeParked`` and ``EnvRefused`` are also ``EnvRefusal``s (the fields of the 409). A test
(tests/unit/test_errors_tree.py) checks that this tree and the classes agree.

At the Temporal boundary each maps to ``ApplicationError(type=<class name>,
non_retryable=not error.transient)``.
"""

from __future__ import annotations

from collections.abc import Iterable


class RollsafeError(Exception):
    """Base of every rollsafe error."""

    transient: bool = False
    # An outcome the design expects (a fence, a skip), not a fault: logged as one INFO line,
    # never with a traceback, here and by the Temporal SDK (ApplicationError category BENIGN).
    expected: bool = False

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
    """The Temporal server did not answer (or a local one failed to start), or its TLS does not
    match the client's settings. ``fix``: what to change, when the cause is known (a TLS
    mismatch names the setting; None: start the server or point TEMPORAL_ADDRESS at it)."""

    fix: str | None = None  # a class default: an instance rebuilt from its message has it

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.fix = fix
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return _rebuild, (type(self), str(self)), dict(vars(self))


class PortTaken(TemporalUnavailable):
    """A local Temporal dev server could not bind its port: another process holds it (one
    picked for it is picked again: rollsafe.temporal.devserver)."""


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


class ContentMismatch(SnapshotCorrupt):
    """A snapshot file's bytes are not those its manifest lists (size, sha256, unreadable):
    a restore that finds one while loading selects the next snapshot."""


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


class JournalCorrupt(InvariantError):
    """A journal segment that cannot be read: not a journal, another format version, another
    run's, or a header that does not match its checksum."""


class JournalGap(JournalCorrupt):
    """The journal does not hold every record after the snapshot: a gap between segments, a
    segment or the whole folder missing, segments of another journal. A restore refuses it
    unless told to accept the loss (``accept_journal_loss``), which its plan then records."""


class JournalFailed(InvariantError):
    """The journal's disk refused a write or a sync (full, read-only, an I/O error) or did
    not sync within its bound. No caller is told the records not yet durable are, and the
    segment takes no more (a torn batch may end its file): every later append and wait raises
    this, naming the segment and the disk's error. Not retried in this process: free or fix the
    disk, then restart the run, which restores from its snapshot and what the journal holds."""


class SchemaMismatch(InvariantError):
    pass


class VersionSkew(InvariantError):
    """Two processes (or a process and a file) of releases too far apart to work together:
    names both versions and what to do (rollsafe.versions)."""


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


class ReplayDiverged(InvariantError):
    """A restored session's agent asked for something its record does not hold: a model or tool
    call that differs from the one made at that place before (the agent is not deterministic
    given the same answers), as Temporal's non-determinism error. The episode is run again
    from its start without the record (docs/gateway.md, "Replay")."""

    def __init__(self, session: str, call: str, detail: str) -> None:
        self.session = session
        self.call = call
        super().__init__(f"session {session}: {call} differs from its record: {detail}")


class EffectDiverged(InvariantError):
    """An effect asked for again (a restored or retried attempt, the same key) with arguments
    other than those it was applied with: the attempt is not deterministic given its record
    (sampling or randomness keyed on something but the rollout and the turn). It is not applied
    a second time; the episode fails and falls back (docs/environment-protocol.md, "Effects")."""

    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        super().__init__(f"effect {key}: {detail}")


class InvalidInput(RollsafeError, ValueError):
    """Malformed input from a user: a file, an argument, an identifier."""


class StorageFailed(TransientError):
    """The snapshot store's filesystem refused a write: no space left, read-only, an I/O
    error. Nothing was published and the run's state is untouched; the next snapshot is taken
    as usual, and publishes once the disk is writable again."""


class SnapshotLost(TransientError):
    """This checkpoint's draft is gone or unusable here: the snapshot must start again from
    ``open`` under a new seq. Transient, so the supervisor counts it as such."""


class AwaitingRestore(TransientError):
    """A fresh controller of a run that already has published snapshots is fenced (docs/design.md
    invariant 8): it takes no work and no snapshot until it has restored, or was started with
    ``start_over=True``. A snapshot of its empty state would become the newest one, and
    retention would delete the run's real state."""

    expected = True


class AdmissionLeaseExpired(TransientError):
    """The checkpoint held admission closed past its lease with no phase renewing it (no
    worker left to run them): the gate reopened by itself, and the snapshot is abandoned
    (its draft discarded, nothing published). The next snapshot starts afresh."""


class AdmissionClosed(TransientError):
    """A dispatch found admission closed (a snapshot parks the run) for longer than it was
    willing to wait: the rollout stays reserved; dispatch it again."""


class AnchorPassed(InvalidInput):
    """A trainer snapshot anchored at weight version N found the controller at another one
    when it came to capture (a step committed first, or the anchor given was not the trainer
    checkpoint's weight version). It is skipped, not failed: a snapshot at another version
    could never be restored with that checkpoint."""

    expected = True


class PhaseConflict(InvalidInput):
    """The phase ledger's conflicts (rollsafe.checkpoint.phase_ledger): a phase call that
    conflicts with what its checkpoint (or another) already did. Never retried: the same call
    meets the same conflict."""


class CheckpointRefused(PhaseConflict):
    """A phase the checkpoint may not run: another checkpoint is open, or this one was
    already aborted or resumed. Retrying cannot help."""


class ControllerUnavailable(TransientError):
    """No controller for the run can be reached: no actor by its name (it may be starting or
    restarting), or a call to it failed on the way."""


class CheckpointSpent(TransientError):
    """This checkpoint id can no longer park the environments (a failed prepare resumed them,
    and a resumed id is refused forever); a new snapshot can."""


class CheckpointBusy(TransientError):
    """``open`` found another checkpoint's draft open. It publishes, is aborted, or is
    discarded by a later open once no phase of it has run for its lease (its workflow was
    terminated): the same open may succeed later, so a supervisor goes on."""


class ObjectStoreUnavailable(TransientError):
    """The object store did not answer or refused a request for a reason that may pass
    (a network error, throttling, S3's 409 ConditionalRequestConflict, no answer in time)."""


class SnapshotsFailed(InvariantError):
    """The run's supervisor failed: no more snapshots are taken until a trainer starts a new
    one (``Checkpointer.start``). ``failure_type`` is the supervisor's error type, e.g.
    ``TooManyConsecutiveSnapshotFailures`` or the invariant error that failed a snapshot."""

    def __init__(self, run_id: str, failure_type: str, message: str) -> None:
        self.run_id = run_id
        self.failure_type = failure_type
        super().__init__(f"checkpointing of run {run_id!r} failed: {failure_type}: {message}")


class RestoreFailed(InvariantError):
    """The run could not be restored (no snapshot verifies, topology differs, ...)."""


class CheckpointMismatch(InvariantError):
    """A trainer checkpoint a restart resumes from does not go with the run: another run's, or
    saved without rollsafe, or of another shape (names which, and the fix). Nothing is changed."""


class SupervisorNotRunning(InvariantError):
    """The run has no running supervisor: never started, stopped or terminated."""


class ServerDidNotStart(RollsafeError):
    """The process exited, or printed no listening line in time; its stderr tail is included."""


class ExtraNotInstalled(RollsafeError):
    """A part of rollsafe needs a package of an optional extra that is not installed."""

    def __init__(self, what: str, extra: str) -> None:
        super().__init__(f"{what} needs the {extra!r} extra: pip install 'rollsafe[{extra}]'")


class InjectedFault(TransientError):
    """Raised by an armed fault point with action ``raise``."""

    def __init__(self, name: str) -> None:
        self.point = name
        super().__init__(f"injected fault at {name}")


class InjectedInvariantFault(InvariantError):
    """Raised by an armed fault point with action ``invariant``: a failure retrying cannot
    fix, as a corrupt snapshot or an ownership mismatch would be."""

    def __init__(self, name: str) -> None:
        self.point = name
        super().__init__(f"injected invariant fault at {name}")


class GateHeld(PhaseConflict):
    """A checkpoint tried to close the gate while another checkpoint holds it closed."""

    def __init__(self, holder: str, requester: str) -> None:
        self.holder = holder
        self.requester = requester
        super().__init__(
            f"admission gate is held closed by checkpoint {holder!r}; checkpoint "
            f"{requester!r} cannot close it until {holder!r} resumes"
        )


class EvidenceError(InvalidInput):
    """An evidence file is missing or malformed (names the file and line)."""


class ScenarioError(InvalidInput):
    """A malformed scenario file or an event that cannot happen (exit code 2)."""


class RunNotFound(InvalidInput):
    """The Temporal server knows no run by that id (a typo, or another namespace): no
    supervisor, no workflow of the run, no worker ever polled its task queue (exit code 2)."""


class ParticipantRefused(InvalidInput):
    """Refused by an environment participant in this phase or for this episode (HTTP 409).
    ``reason``: ``checkpoint_parked``, ``retired``, ``already_running``, ``wrong_phase``,
    ``other_checkpoint``, ``checkpoint_resumed``, ``not_parked`` or ``superseded`` (a newer
    attempt of the rollout was restored or run on the instance: this one makes no more
    effects)."""

    reason: str = "refused"  # also after _rebuild, which skips __init__

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


class EnvRefusal(RollsafeError):
    """An instance's 409: it understood the call and refused it in its current phase."""

    # Class defaults, so an instance rebuilt by _rebuild still has every field.
    url: str = ""
    op: str = ""
    reason: str = ""
    detail: str = ""

    def __init__(self, url: str, op: str, reason: str, detail: str = "") -> None:
        self.url = url
        self.op = op
        self.reason = reason
        self.detail = detail
        tail = f": {detail}" if detail else ""
        super().__init__(f"environment at {url}: {op} refused ({reason}){tail}")

    def __reduce__(self) -> tuple[object, ...]:
        # The base keeps only class and message; the fields travel as pickle state (Ray).
        return _rebuild, (type(self), str(self)), dict(vars(self))


class EpisodeParked(EnvRefusal, EnvNotReady):
    """409 ``checkpoint_parked``: the instance is parked for a checkpoint and did not start the
    episode. Re-send the same :class:`RunEpisode` once it is idle; no attempt is spent."""


class EnvRefused(EnvRefusal, InvalidInput):
    """Any other 409 (``retired``, ``wrong_phase``, ``other_checkpoint``,
    ``checkpoint_resumed``, ``already_running``): re-sending the same call cannot succeed."""
