"""How :class:`~rollsafe.env.fleet.EnvFleet` reaches its instances, apart from its rules.

:class:`Instances` holds the named clients and calls them all at once, attributing each result
and each failure to its instance name; :class:`LeaseRenewer` renews an open checkpoint's leases
in the background; :func:`until_idle` polls a parked instance until it is idle again. What the
calls mean (all or nothing, ownership, restore) is decided in :mod:`rollsafe.env.fleet`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TypeVar

from rollsafe.env.client import EnvClient
from rollsafe.env.fleet_rules import FleetPrepared, failures_summary
from rollsafe.env.protocol import RenewRequest
from rollsafe.errors import EnvUnavailable, InvalidInput, TransientError

log = logging.getLogger(__name__)
T = TypeVar("T")
_INSTANCE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_RENEW_EVERY_S = 10.0
MIN_RENEW_EVERY_S = 0.1
MAX_POLL_S = 2.0


def misnamed(name: str, url: str, calls_itself: str) -> str:
    """What is wrong when the run's name for an instance is not the instance's own."""
    return (
        f"participants.envs names the instance at {url} {name!r}, but it calls itself "
        f"{calls_itself!r} (its --instance): start it with `--instance {name}`, or name it "
        f"{calls_itself!r} in participants.envs. Its commits and restores are filed under "
        "its own name, so the two must agree"
    )


class Instances:
    """The fleet's clients by instance name (the name of each one's directory under a commit's
    ``dest_root``, hence the restricted spelling)."""

    def __init__(self, clients: Mapping[str, EnvClient]) -> None:
        if not clients:
            raise InvalidInput("an environment fleet needs at least one instance")
        for name in clients:
            if not _INSTANCE.match(name) or name in (".", ".."):
                raise InvalidInput(f"instance name {name!r} is not [A-Za-z0-9._-]{{1,64}}")
        self._clients = dict(clients)
        self.names: tuple[str, ...] = tuple(sorted(self._clients))
        self._identified: set[str] = set()  # answered status with the name the run gives it

    async def identify(self, name: str) -> None:
        """Once per instance, before the first call that counts: its status must name it as
        the run does, or nothing is sent to it (:func:`misnamed`)."""
        if name in self._identified:
            return
        client = self.client(name)
        try:
            status = await client.status()
        except TransientError:
            return  # down for now: the call itself finds that; identified at a later one
        if status.instance != name:
            raise InvalidInput(misnamed(name, client.base_url, status.instance))
        self._identified.add(name)

    def client(self, name: str) -> EnvClient:
        try:
            return self._clients[name]
        except KeyError:
            raise InvalidInput(f"no environment instance {name!r} (have {self.names})") from None

    def check_known(
        self, by_instance: Mapping[str, object], what: str, cls: type[Exception]
    ) -> None:
        unknown = sorted(set(by_instance) - set(self.names))
        if unknown:
            raise cls(f"{what} names unknown instance(s) {unknown}; the fleet has {self.names}")

    async def each(
        self, names: Iterable[str], call: Callable[[str, EnvClient], Awaitable[T]]
    ) -> tuple[dict[str, T], dict[str, Exception]]:
        """``call`` on every named instance at once: results and failures by instance."""
        names = tuple(names)
        outcomes = await asyncio.gather(
            *(call(name, self._clients[name]) for name in names), return_exceptions=True
        )
        done: dict[str, T] = {}
        failed: dict[str, Exception] = {}
        for name, outcome in zip(names, outcomes, strict=True):
            if isinstance(outcome, Exception):
                failed[name] = outcome
            elif isinstance(outcome, BaseException):  # cancellation: not a result to keep
                raise outcome
            else:
                done[name] = outcome
        return done, failed

    def summary(self, op: str, failed: Mapping[str, Exception]) -> Exception:
        """One error for the failures, after one log line per failing instance (which one,
        refusing or unreachable, and why)."""
        for name, exc in sorted(failed.items()):
            log.warning(
                "%s failed on environment instance %s: %s: %s",
                op,
                name,
                type(exc).__name__,
                exc,
                extra={"op": op, "instance": name, "error_type": type(exc).__name__},
            )
        return failures_summary(op, failed, len(self.names))

    async def aclose(self) -> None:
        await asyncio.gather(*(client.aclose() for client in self._clients.values()))


class LeaseRenewer:
    """The background renewals of one open checkpoint."""

    def __init__(
        self, instances: Instances, checkpoint_id: str, window_s: float, every_s: float
    ) -> None:
        self.instances = instances
        self.checkpoint_id = checkpoint_id
        self.window_s = window_s
        self.every_s = every_s
        self.rounds = 0
        self.failures: dict[str, str] = {}  # the latest failure per instance

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            await self._round()

    async def _round(self) -> None:
        request = RenewRequest(
            checkpoint_id=self.checkpoint_id, deadline_ts=time.time() + self.window_s
        )
        # A failed renewal is not fatal here: the next round tries again, and a lease that did
        # run out makes the body's next call (commit) fail on its own.
        instances = self.instances
        _, failed = await instances.each(instances.names, lambda _, c: c.renew(request))
        self.rounds += 1
        for name, exc in failed.items():
            log.warning("renew %s on %s failed: %s", self.checkpoint_id, name, exc)
            self.failures[name] = str(exc)

    def notes(self) -> list[str]:
        return [f"renewal on {name} failed: {why}" for name, why in sorted(self.failures.items())]


def renewal_interval(prepared: FleetPrepared) -> float:
    """A third of the shortest lease, within [MIN_RENEW_EVERY_S, MAX_RENEW_EVERY_S]."""
    lease_s = prepared.lease_expires_ts - time.time()
    return max(min(lease_s / 3, MAX_RENEW_EVERY_S), MIN_RENEW_EVERY_S)


async def stop_task(task: asyncio.Task[None]) -> None:
    # asyncio.wait, not `await task`: the task's CancelledError must not be mistaken for (or
    # swallow) a cancellation of the caller.
    task.cancel()
    await asyncio.wait({task})


async def until_idle(client: EnvClient, give_up: float, first_s: float) -> None:
    """Poll status with backoff until the instance is idle or ``give_up`` passes. An instance
    that cannot answer for now (:class:`EnvUnavailable`: its checkpoint endpoints failing while
    it is parked) is asked again: a lost controller's lease resumes it by itself."""
    delay = first_s
    while True:
        await asyncio.sleep(max(min(delay, give_up - time.monotonic()), 0.0))
        try:
            idle = (await client.status()).phase == "idle"
        except EnvUnavailable as exc:
            log.debug("waiting for %s to be idle: %s", client.base_url, exc)
            idle = False
        if idle or time.monotonic() >= give_up:
            return
        delay = min(delay * 2, MAX_POLL_S)
