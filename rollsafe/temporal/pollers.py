"""Is any checkpoint worker serving a run? What the Temporal server knows of the workers that
poll the run's task queue (``DescribeTaskQueue``), without asking a worker.

The server records a poll when it starts. An idle worker's long poll lasts up to about a
minute (measured here: the newest poll of an idle, live worker was up to 55 s old), and the
server goes on listing a stopped worker for minutes, with its poll ageing. So a worker
counts as present when one of its polls started within :data:`WORKER_SEEN_WITHIN_S`: a
live worker always is; a dead one stops being within that bound. (Ages are read against this
host's clock: ``rollsafe doctor`` checks its skew against the server's.)
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

WORKER_SEEN_WITHIN_S = 90.0


class WorkerPresence(BaseModel):
    """The workers of one task queue, as the Temporal server has seen them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_queue: str
    pollers: int  # workers the server lists (recent ones, live or not)
    newest_poll_age_s: float | None  # since the newest poll started; None: none listed
    seen_within_s: float  # the bound below

    @property
    def present(self) -> bool:
        """A worker polled within the bound."""
        return self.newest_poll_age_s is not None and self.newest_poll_age_s <= self.seen_within_s

    def absence(self) -> str:
        """Why no worker counts as present, in an operator's words."""
        seen = (
            "no worker has ever polled it"
            if self.newest_poll_age_s is None
            else f"the newest poll started {self.newest_poll_age_s:.0f} s ago"
        )
        return (
            f"no checkpoint worker polls task queue {self.task_queue!r} ({seen}): no snapshot "
            "is taken until one does (`rollsafe worker --run RUN`)"
        )


async def worker_presence(
    client: Client, task_queue: str, seen_within_s: float = WORKER_SEEN_WITHIN_S
) -> WorkerPresence:
    """One ``DescribeTaskQueue`` call (a few milliseconds) for the workflow task queue, which
    every rollsafe worker polls."""
    request = DescribeTaskQueueRequest(
        namespace=client.namespace,
        task_queue=TaskQueue(name=task_queue),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
    )
    reply = await client.workflow_service.describe_task_queue(request)
    now = time.time()
    ages = [
        max(0.0, now - poller.last_access_time.ToMicroseconds() / 1e6)
        for poller in reply.pollers
        if poller.HasField("last_access_time")
    ]
    return WorkerPresence(
        task_queue=task_queue,
        pollers=len(reply.pollers),
        newest_poll_age_s=min(ages) if ages else None,
        seen_within_s=seen_within_s,
    )
