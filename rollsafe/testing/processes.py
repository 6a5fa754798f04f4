"""One generation of a test's server processes (an engine, a gateway, NeMo Gym's servers...):
SIGKILLed together, as a machine failure kills them, or stopped together, the last started
first. Each is ended by its pid (:class:`rollsafe.http.served.ServedProcess`,
:class:`rollsafe.gym.servers.GymServers`)."""

from __future__ import annotations

from typing import Protocol


class Ends(Protocol):
    def crash(self) -> None: ...

    def stop(self) -> None: ...


class Generation:
    def __init__(self) -> None:
        self.started: list[Ends] = []  # in start order

    def crash(self) -> None:
        for process in self.started:
            process.crash()

    def stop(self) -> None:
        for process in reversed(self.started):
            process.stop()
