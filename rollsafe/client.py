"""The trainer SDK: how a training loop tells its run's checkpoint workflows what happened.

::

    ckpt = await Checkpointer("run-7", interval_s=600).start()
    for step in ...:
        ...  # optimizer step committed
        await ckpt.train_step_committed(step)
    outcome = await ckpt.snapshot_now(timeout=120)

:class:`SyncCheckpointer` has the same calls for a training loop that is not async
(``ckpt.train_step_committed(step)``, no ``await``), with the same errors. Both read their
settings (run id, Temporal, snapshot interval, phase options) from :class:`rollsafe.Settings`.

What the trainer says on its hot path (``train_step_committed``, ``trainer_checkpoint_saved``
and ``_removed``) is one signal to the run's supervisor (``rollsafe/{run_id}``): durable once
the server has it, no worker needed, bounded by ``notify_timeout_s``. Only when the server
refuses it does the SDK ask why, so a supervisor that has failed raises
:class:`SnapshotsFailed` naming why at the trainer's next step, not in a log line.

A run no worker serves takes no snapshot, however long it trains: every
:meth:`Checkpointer.status` and, from ``worker_check_every_s`` after :meth:`Checkpointer.start`
on and at most that often, ``train_step_committed`` look at the run's task queue, and the SDK
logs a warning (once, until a worker is back) when no worker polls it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import time
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Self, TypeVar

from pydantic import BaseModel, ConfigDict
from temporalio.client import (
    Client,
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from rollsafe.core.ids import restore_workflow_id, supervisor_id, task_queue_for, validate_run_id
from rollsafe.core.phases import RestorePlan, RestoreRequest
from rollsafe.errors import (
    CheckpointTimeout,
    InvalidInput,
    RestoreFailed,
    SnapshotsFailed,
    SupervisorNotRunning,
    TemporalUnavailable,
)
from rollsafe.loop_thread import LoopThread
from rollsafe.settings import Settings
from rollsafe.temporal.connect import ConnectionSettings, connect
from rollsafe.temporal.failures import describe_failure
from rollsafe.temporal.pollers import WORKER_SEEN_WITHIN_S, WorkerPresence, worker_presence
from rollsafe.workflows.models import (
    PhaseOptions,
    SnapshotOutcome,
    SupervisorInput,
    SupervisorStatus,
)
from rollsafe.workflows.restore import RestoreRun
from rollsafe.workflows.supervisor import SnapshotSupervisor

if TYPE_CHECKING:
    from rollsafe.checkpoint.controller import Controller

# Queries and updates need a live worker: say so, rather than hang, when none serves the run.
WORKER_TIMEOUT_S = 5.0
# A signal to the supervisor (a trainer step's notice) returns within this, or raises.
NOTIFY_TIMEOUT_S = 2.0
# train_step_committed looks at the run's task queue at most this often (one RPC).
WORKER_CHECK_EVERY_S = 30.0

T = TypeVar("T")
SupervisorHandle = WorkflowHandle[SnapshotSupervisor, None]
log = logging.getLogger(__name__)


async def _within(seconds: float | None, call: Awaitable[T]) -> T:
    """``call``, or TimeoutError after ``seconds``. The SDK turns the deadline's cancellation
    of an update into its own error: ask the deadline whether it fired instead."""
    try:
        async with asyncio.timeout(seconds) as deadline:
            return await call
    except WorkflowUpdateRPCTimeoutOrCancelledError:
        if deadline.expired():
            raise TimeoutError from None
        raise


class CheckpointerStatus(BaseModel):
    """What :meth:`Checkpointer.status` reports."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    workers: WorkerPresence  # who polls the run's task queue, from the server
    supervisor: SupervisorStatus | None  # None: no worker answered its status query
    warnings: list[str]  # what keeps the run from being checkpointed, if anything


class Checkpointer:
    """One run's checkpointing, seen from the trainer (:class:`SyncCheckpointer`: the same
    calls for a loop that is not async).

    ``settings`` (default :meth:`rollsafe.Settings.load`: environment variables and
    ``ROLLSAFE_CONFIG``'s file) give the run id when ``run_id`` is None, the Temporal
    connection and the supervisor's settings (``snapshots:`` and ``phases:``); the keywords
    ``interval_s``, ``max_consecutive_failures`` and ``options`` override those. They configure
    the supervisor when :meth:`start` creates it; a trainer attaching to a running one gets that
    one's. ``connection`` replaces the settings' Temporal connection; ``client`` (tests, or a
    caller that already has one) replaces both and must use the pydantic data converter, as
    :func:`rollsafe.temporal.connect.connect` does.
    """

    worker_timeout_s = WORKER_TIMEOUT_S  # how long a query or update waits for a worker
    notify_timeout_s = NOTIFY_TIMEOUT_S  # how long a signal may take
    worker_check_every_s = WORKER_CHECK_EVERY_S
    worker_seen_within_s = WORKER_SEEN_WITHIN_S  # a worker polled this recently: present

    def __init__(  # noqa: PLR0913 (the SDK's options, keyword-only, each defaulted)
        self,
        run_id: str | None = None,
        *,
        settings: Settings | None = None,
        connection: ConnectionSettings | None = None,
        task_queue: str | None = None,
        interval_s: float | None = None,
        max_consecutive_failures: int | None = None,
        options: PhaseOptions | None = None,
        participants: bool = True,
        client: Client | None = None,
    ) -> None:
        if settings is None:
            settings = Settings.load()
        self.run_id = validate_run_id(run_id if run_id is not None else settings.require_run_id())
        self.task_queue = task_queue or task_queue_for(self.run_id)
        self.config = settings.supervisor_config(
            self.run_id,
            # False: the run has no environments or engines (see SnapshotInput.participants)
            participants=participants,
            interval_s=interval_s,
            max_consecutive_failures=max_consecutive_failures,
            options=options,
        )
        # Trainer checkpoint paths by step: the supervisor's signal carries only the step.
        self.saved_checkpoints: dict[int, str] = {}
        # The anchors this trainer knows it holds (None: it has said nothing yet); start()
        # hands them to the supervisor, which may be new or may hold older ones.
        self._anchors: set[int] | None = None
        self._settings = settings
        self._connection = connection
        self._client = client
        self._workers_checked_at: float | None = None
        self._warned_no_worker = False

    @property
    def workflow_id(self) -> str:
        return supervisor_id(self.run_id)

    async def start(self) -> Self:
        """Connect (unless a client was given) and start the run's supervisor, or attach to
        the one already running: a restarted trainer continues the same run's checkpointing.
        After a failed or stopped supervisor this starts a fresh one. The anchors this
        trainer knows (from :meth:`restore`'s ``weight_versions`` and the checkpoints it
        saved) replace the supervisor's."""
        client = await self._connected()
        held = self._anchors
        with self._outage("starting the supervisor"):
            await client.start_workflow(
                SnapshotSupervisor.run,
                SupervisorInput(config=self.config),
                id=self.workflow_id,
                task_queue=self.task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                start_signal=None if held is None else "trainer_checkpoints_held",
                start_signal_args=[] if held is None else [sorted(held)],
            )
        # Workers and trainer often start together: the first look, a step's, comes after
        # worker_check_every_s, so a worker still connecting is not reported missing.
        self._workers_checked_at = time.monotonic()
        return self

    async def train_step_committed(self, step: int) -> None:
        """Tell the run a train step committed: a rollout snapshot that has not captured yet
        goes on and captures the state after it; an anchored snapshot (one
        ``trainer_checkpoint_saved`` asked for) that has not captured yet aborts (its outcome:
        ``skipped``, reason ``trainer_state_changed: step N committed``). One signal,
        returned once the server has it (within ``notify_timeout_s``, else
        :class:`TemporalUnavailable`); no worker is waited for."""
        await self._notify(SnapshotSupervisor.train_step_committed, _step(step))
        if self._workers_due():
            try:
                await self._check_workers()
            except (RPCError, TimeoutError) as exc:  # a look, not the step's business
                log.debug("run %s: looking for workers failed: %s", self.run_id, exc)

    # `timeout`: as snapshot_now's.
    async def trainer_checkpoint_saved(
        self,
        step: int,
        path: str,
        *,
        wait: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> SnapshotOutcome | None:
        """The trainer saved a checkpoint of weight version ``step`` (the number of optimizer
        steps committed; the controller's weight version goes up by one per committed step):
        ask for a snapshot anchored to it, and hold it as an anchor, so retention keeps the
        newest snapshot at that weight version until :meth:`trainer_checkpoint_removed`.
        ``path`` is kept in :attr:`saved_checkpoints` on this side only.

        ``wait=False``: one signal, returns None; the anchored snapshot is skipped if a step
        commits before it captures. ``wait=True``: returns that snapshot's outcome (call it
        before the next step commits to be sure of a snapshot at ``step``); after
        ``timeout`` seconds :class:`CheckpointTimeout`, as :meth:`snapshot_now`."""
        step = _step(step)
        # Held from here on, whether the server hears of it now or not: the next start()
        # sends every anchor held (the recipe after a Temporal outage, docs/deploy.md).
        self.saved_checkpoints[step] = path
        self._anchors = {*(self._anchors or ()), step}
        if wait:
            return await self._update(SnapshotSupervisor.trainer_checkpoint_snapshot, timeout, step)
        await self._notify(SnapshotSupervisor.trainer_checkpoint_saved, step)
        return None

    async def trainer_checkpoint_removed(self, step: int) -> None:
        """The trainer deleted its checkpoint of weight version ``step``: retention no longer
        keeps a snapshot for it."""
        step = _step(step)
        self.saved_checkpoints.pop(step, None)  # as trainer_checkpoint_saved: held here first
        self._anchors = (self._anchors or set()) - {step}
        await self._notify(SnapshotSupervisor.trainer_checkpoint_removed, step)

    # `timeout`: the SDK's documented keyword; it bounds the update
    # and maps to CheckpointTimeout, which asyncio.timeout around the call would not.
    async def snapshot_now(self, timeout: float | None = None) -> SnapshotOutcome:  # noqa: ASYNC109
        """Take a rollout snapshot now (after any queued ones) and return its outcome. After
        ``timeout`` seconds raises :class:`CheckpointTimeout`; a request that reached the
        supervisor is not withdrawn: that snapshot still runs, and its outcome later shows in
        ``status().supervisor.state.last_outcome``."""
        return await self._update(SnapshotSupervisor.snapshot_now, timeout)

    async def status(self) -> CheckpointerStatus:
        """The workers the server sees on the run's task queue and, when one answers within
        ``worker_timeout_s``, the supervisor's counts, last outcome and running snapshot.
        Raises the supervisor's own error when it is not running."""
        handle = await self._supervisor()
        workers = await self._check_workers()
        supervisor: SupervisorStatus | None = None
        warnings = [] if workers.present else [workers.absence()]
        if workers.present:
            try:
                supervisor = await handle.query(
                    SnapshotSupervisor.status, rpc_timeout=timedelta(seconds=self.worker_timeout_s)
                )
            except RPCError as exc:
                # The server holds a query until a worker takes it: a timeout means none did.
                if exc.status not in (RPCStatusCode.CANCELLED, RPCStatusCode.DEADLINE_EXCEEDED):
                    raise
                await self._running(handle)  # closed meanwhile: say so instead
                warnings.append(f"no checkpoint worker answered within {self.worker_timeout_s:g} s")
        if supervisor is not None and supervisor.warning is not None:
            warnings.append(supervisor.warning)
        return CheckpointerStatus(
            run_id=self.run_id, workers=workers, supervisor=supervisor, warnings=warnings
        )

    async def workers(self) -> WorkerPresence:
        """Who polls the run's task queue, as the Temporal server has seen them (no worker
        needed to answer)."""
        client = await self._connected()
        with self._outage("looking for workers"):
            return await worker_presence(client, self.task_queue, self.worker_seen_within_s)

    # `timeout`: as snapshot_now's.
    async def stop(self, *, wait: bool = False, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """End the run's periodic snapshots: the supervisor finishes its current one first.
        ``wait=True``: return once it has ended (a worker must serve the run meanwhile, e.g.
        :meth:`worker` in this process); :class:`CheckpointTimeout` after ``timeout``."""
        await self._notify(SnapshotSupervisor.stop)
        if not wait:
            return
        try:
            await _within(timeout, self._handle().result())
        except TimeoutError:
            raise CheckpointTimeout(
                f"run {self.run_id!r}: the supervisor did not end within {timeout:g} s"
            ) from None

    async def restore(
        self,
        restore_id: str,
        weight_versions: Sequence[int] | None = None,
        *,
        accept_journal_loss: bool = False,
    ) -> RestorePlan:
        """Restore the run's controller from its newest snapshot that verifies, through the
        RestoreRun workflow (docs/design.md section 6). Idempotent per ``restore_id``: a retried
        restore returns the first plan. Needs no supervisor: a trainer restores before
        :meth:`start`. ``weight_versions``: those the trainer holds checkpoints of (its
        anchors, which :meth:`start` then hands to the supervisor); only a snapshot taken at
        one of them is restored (None: any). A snapshot that cannot be restored raises
        :class:`RestoreFailed` naming the error; the run refuses to start rather than start
        from nothing. ``accept_journal_loss``: restore although the journal does not continue
        the snapshot (refused by default, naming the gap: docs/journal.md, "What a restore
        does with damage"); the plan says what was given up."""
        client = await self._connected()
        anchors = tuple(weight_versions) if weight_versions is not None else None
        request = RestoreRequest(
            run_id=self.run_id,
            restore_id=restore_id,
            weight_versions=anchors,
            accept_journal_loss=accept_journal_loss,
        )
        try:
            with self._outage(f"restore {restore_id}"):
                plan = await client.execute_workflow(
                    RestoreRun.run,
                    request,
                    id=restore_workflow_id(self.run_id, restore_id),
                    task_queue=self.task_queue,
                )
        except WorkflowFailureError as exc:
            error_type, message = describe_failure(exc)
            raise RestoreFailed(
                f"restore of run {self.run_id!r} failed: {error_type}: {message}"
            ) from exc
        if anchors is not None:
            self._anchors = set(anchors)
        return plan

    @contextlib.asynccontextmanager
    async def worker(self, controller: Controller) -> AsyncIterator[Self]:
        """A checkpoint worker in this process, on this event loop, for ``controller`` (the
        run's, in this process): snapshots and restores run while the block does. For a run
        without Ray, whose controller no ``rollsafe worker`` process can reach; it stops with
        the trainer, and the supervisor, kept by Temporal, waits for the next one. With Ray, run
        ``rollsafe worker`` processes instead (docs/deploy.md)."""
        from rollsafe.activities.controllers import LocalControllerClient
        from rollsafe.workers.checkpoint import build_worker

        if controller.store.run_id != self.run_id:
            raise InvalidInput(
                f"the controller is run {controller.store.run_id!r}'s, not {self.run_id!r}'s"
            )
        local = LocalControllerClient(controller)
        async with build_worker(await self._connected(), self.task_queue, lambda _: local):
            yield self

    # ---- helpers ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _outage(self, doing: str) -> Iterator[None]:
        """An unreachable server (stopped, restarting, the network) is TemporalUnavailable,
        transient: the same call succeeds once it is back. Every other answer goes through."""
        try:
            yield
        except RPCError as exc:
            if exc.status != RPCStatusCode.UNAVAILABLE:
                raise
            raise TemporalUnavailable(
                f"run {self.run_id!r}: {doing}: the Temporal server did not answer ({exc.message})"
            ) from exc

    async def _connected(self) -> Client:
        if self._client is None:
            self._client = await connect(self._connection or self._settings.connection())
        return self._client

    def _handle(self) -> SupervisorHandle:
        if self._client is None:
            raise SupervisorNotRunning(f"run {self.run_id!r}: call Checkpointer.start() first")
        return self._client.get_workflow_handle_for(SnapshotSupervisor.run, self.workflow_id)

    async def _supervisor(self) -> SupervisorHandle:
        """The running supervisor's handle (one ``describe``); a failed or closed one raises
        its own error."""
        handle = self._handle()
        await self._running(handle)
        return handle

    # `timeout`: the public calls' keyword, passed on.
    async def _update(
        self,
        update: Any,
        timeout: float | None,  # noqa: ASYNC109
        *args: Any,
    ) -> SnapshotOutcome:
        """Run a supervisor update that answers with a snapshot's outcome, within ``timeout``."""
        handle = await self._supervisor()
        # The server went away while the update waited: TemporalUnavailable, and the snapshot
        # (if the request reached the supervisor) still runs; its outcome shows in status().
        with self._outage("waiting for the snapshot"):
            try:
                call = handle.execute_update(update, *args)
                outcome: SnapshotOutcome = await _within(timeout, call)
            except TimeoutError:
                raise CheckpointTimeout(
                    f"run {self.run_id!r}: the snapshot did not finish within {timeout:g} s"
                ) from None
            except (RPCError, WorkflowUpdateFailedError):
                await self._running(handle)  # raises the supervisor's own error if it closed
                raise
        return outcome

    async def _notify(self, signal: Any, *args: Any) -> None:
        """Signal the supervisor within ``notify_timeout_s``. Only a refusal costs a
        ``describe``, which names why (failed, stopped, never started)."""
        handle = self._handle()
        try:
            await _within(
                self.notify_timeout_s,
                handle.signal(signal, *args, rpc_timeout=timedelta(seconds=self.notify_timeout_s)),
            )
        except TimeoutError:
            raise TemporalUnavailable(
                f"run {self.run_id!r}: the Temporal server did not take the notice within "
                f"{self.notify_timeout_s:g} s"
            ) from None
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                await self._running(handle)  # raises why it is not running
            if exc.status in (RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.UNAVAILABLE):
                raise TemporalUnavailable(
                    f"run {self.run_id!r}: signalling {self.workflow_id} failed: "
                    f"{exc.status.name} {exc.message}"
                ) from exc
            raise

    def _workers_due(self) -> bool:
        checked = self._workers_checked_at
        return checked is None or time.monotonic() - checked >= self.worker_check_every_s

    async def _check_workers(self) -> WorkerPresence:
        """Look at the run's task queue; warn once when no worker polls it (again once a
        worker came back and went away)."""
        self._workers_checked_at = time.monotonic()
        workers = await _within(self.notify_timeout_s, self.workers())
        if workers.present:
            self._warned_no_worker = False
        elif not self._warned_no_worker:
            self._warned_no_worker = True
            log.warning("run %s: %s", self.run_id, workers.absence())
        return workers

    async def _running(self, handle: SupervisorHandle) -> WorkflowExecutionDescription:
        try:
            description = await handle.describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise TemporalUnavailable(
                    f"run {self.run_id!r}: describing {self.workflow_id} failed: "
                    f"{exc.status.name} {exc.message}"
                ) from exc
            raise SupervisorNotRunning(
                f"run {self.run_id!r} has no checkpoint supervisor ({self.workflow_id}); "
                "call Checkpointer.start() first"
            ) from None
        if description.status == WorkflowExecutionStatus.RUNNING:
            return description
        if description.status == WorkflowExecutionStatus.FAILED:
            raise await self._failure(description.run_id)
        state = description.status.name if description.status else "UNKNOWN"
        raise SupervisorNotRunning(
            f"checkpoint supervisor of run {self.run_id!r} is {state}; call "
            "Checkpointer.start() to start a new one"
        )

    async def _failure(self, run_id: str) -> SnapshotsFailed:
        # describe() has no failure details; the failed run's result has the typed error
        # (that run exactly: a trainer may have started a new supervisor meanwhile).
        assert self._client is not None
        try:
            await self._client.get_workflow_handle(self.workflow_id, run_id=run_id).result()
        except WorkflowFailureError as exc:
            return SnapshotsFailed(self.run_id, *describe_failure(exc))
        return SnapshotsFailed(self.run_id, "Unknown", "the supervisor failed")


class SyncCheckpointer:
    """:class:`Checkpointer` for a training loop that is not async: the same calls, blocking,
    with the same arguments, results and errors. Its Temporal client lives on an event loop of
    its own, on a thread; :meth:`close` (or ``with``) ends it.

    ::

        with SyncCheckpointer(settings=settings) as ckpt:
            ckpt.start()
            for step in ...:
                ...  # optimizer step committed
                ckpt.train_step_committed(step)
    """

    def __init__(self, run_id: str | None = None, **options: Any) -> None:
        """As :class:`Checkpointer`; a ``client`` given here must have been made on
        :attr:`loop` (the SDK connects by itself otherwise)."""
        self.loop = LoopThread("rollsafe-sdk")
        self.checkpointer = Checkpointer(run_id, **options)

    @property
    def run_id(self) -> str:
        return self.checkpointer.run_id

    @property
    def saved_checkpoints(self) -> dict[int, str]:
        return self.checkpointer.saved_checkpoints

    @property
    def workflow_id(self) -> str:
        return self.checkpointer.workflow_id

    def start(self) -> Self:
        self.loop.run(self.checkpointer.start())
        return self

    def train_step_committed(self, step: int) -> None:
        self.loop.run(self.checkpointer.train_step_committed(step))

    def trainer_checkpoint_saved(
        self, step: int, path: str, *, wait: bool = False, timeout: float | None = None
    ) -> SnapshotOutcome | None:
        saved = self.checkpointer.trainer_checkpoint_saved(step, path, wait=wait, timeout=timeout)
        return self.loop.run(saved)

    def trainer_checkpoint_removed(self, step: int) -> None:
        self.loop.run(self.checkpointer.trainer_checkpoint_removed(step))

    def snapshot_now(self, timeout: float | None = None) -> SnapshotOutcome:
        return self.loop.run(self.checkpointer.snapshot_now(timeout))

    def status(self) -> CheckpointerStatus:
        return self.loop.run(self.checkpointer.status())

    def workers(self) -> WorkerPresence:
        return self.loop.run(self.checkpointer.workers())

    def stop(self, *, wait: bool = False, timeout: float | None = None) -> None:
        self.loop.run(self.checkpointer.stop(wait=wait, timeout=timeout))

    def restore(
        self,
        restore_id: str,
        weight_versions: Sequence[int] | None = None,
        *,
        accept_journal_loss: bool = False,
    ) -> RestorePlan:
        return self.loop.run(
            self.checkpointer.restore(
                restore_id, weight_versions, accept_journal_loss=accept_journal_loss
            )
        )

    @contextlib.contextmanager
    def worker(self, controller: Controller) -> Iterator[Self]:
        """As :meth:`Checkpointer.worker`: the worker runs on this SDK's event loop thread."""
        running = self.checkpointer.worker(controller)
        self.loop.run(running.__aenter__())
        try:
            yield self
        except BaseException as exc:
            if not self.loop.run(running.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            self.loop.run(running.__aexit__(None, None, None))

    def close(self) -> None:
        """End the SDK's event loop (the run's supervisor goes on in Temporal)."""
        self.loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _step(step: int) -> int:
    """A step (or weight version) as the supervisor's signals carry it: an int >= 0 (numpy
    integers too, as training loops often count with them)."""
    try:
        value = operator.index(step)
    except TypeError:
        value = -1
    if isinstance(step, bool) or value < 0:
        raise InvalidInput(f"a step is an integer >= 0, got {step!r}")
    return value
