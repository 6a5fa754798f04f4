"""Serve an environment's hooks as a checkpoint participant over HTTP, until SIGINT/SIGTERM.

From the command line, with hooks of your own::

    ROLLSAFE_ENV_TOKEN=T ROLLSAFE_ENGINE_TOKEN=E rollsafe env serve \\
        --hooks my_env:make_env --port 8400 --engine-url http://127.0.0.1:8300

``make_env`` (a class or a function) is called with a :class:`ServeContext` and returns an
:class:`~rollsafe.env.hooks.EnvironmentHooks`. From your own code: ``await serve(hooks,
host=..., port=..., token=...)``. Either way the lease watcher runs, and one line is printed
once the server listens: ``rollsafe env serving <name> <instance> on http://host:port``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from rollsafe.engine.protocol import Engine
from rollsafe.env.hooks import EnvironmentHooks
from rollsafe.env.participant import LEASE_GRACE_S, TOOL_WAIT_S
from rollsafe.errors import InvalidInput
from rollsafe.http.served import listening_url, server_config
from rollsafe.observability.tracing import configure_tracing

log = logging.getLogger(__name__)
Asgi = Callable[..., Any]  # an ASGI application


@dataclass(frozen=True)
class ServeContext:
    """What a hooks factory (``--hooks module:factory``) is given."""

    engine: Engine | None  # the policy engine at --engine-url; None without one
    # --instance as given; None: the default, <hooks.name>-<pid>, named once the hooks exist.
    instance: str | None = None
    # The hooks' own options: --hooks-options-file (a JSON object of strings), then each
    # --hooks-option KEY=VALUE over it. Read what you know; refuse (InvalidInput) what you don't.
    options: Mapping[str, str] = field(default_factory=dict)


HooksFactory = Callable[[ServeContext], EnvironmentHooks]


def default_instance(name: str) -> str:
    return f"{name}-{os.getpid()}"


def load_hooks_factory(spec: str) -> HooksFactory:
    """``package.module:attribute``, imported from the current directory first (as ``uvicorn
    module:app`` does: your ``my_env.py`` beside you needs no install), then from the installed
    packages; refused with the reason when it cannot be."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise InvalidInput(f"--hooks {spec!r}: expected package.module:factory")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInput(f"--hooks {spec!r}: cannot import {module_name!r}: {exc}") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise InvalidInput(f"--hooks {spec!r}: {module_name} has no callable {attribute!r}")
    return factory  # type: ignore[no-any-return]  # checked to be callable; its result below


def hooks_options(pairs: Sequence[str], file: Path | None = None) -> dict[str, str]:
    """``--hooks-options-file`` (a JSON object whose values are strings) with each
    ``--hooks-option KEY=VALUE`` over it; refused by name when malformed."""
    options: dict[str, str] = {}
    if file is not None:
        try:
            loaded = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"--hooks-options-file {file}: {exc}") from None
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in loaded.items()
        ):
            raise InvalidInput(f"--hooks-options-file {file}: not a JSON object of strings")
        options.update(loaded)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidInput(f"--hooks-option {pair!r}: expected KEY=VALUE")
        options[key] = value
    return options


def make_hooks(factory: HooksFactory, context: ServeContext) -> EnvironmentHooks:
    hooks = factory(context)
    if not isinstance(hooks, EnvironmentHooks):
        raise InvalidInput(
            f"the hooks factory returned {type(hooks).__name__}, not an EnvironmentHooks"
        )
    return hooks


class _Server(uvicorn.Server):
    """Prints the listening line once listening."""

    def __init__(self, config: uvicorn.Config, name: str, instance: str) -> None:
        super().__init__(config)
        self.name, self.instance = name, instance

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            url = listening_url(self)
            print(f"rollsafe env serving {self.name} {self.instance} on {url}", flush=True)
            log.info("environment %s instance %s serving on %s", self.name, self.instance, url)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        log.info("environment instance %s stopping", self.instance)
        await super().shutdown(sockets)
        log.info("environment instance %s stopped", self.instance)


async def serve(  # noqa: PLR0913 (the serve command's options, passed on)
    hooks: EnvironmentHooks,
    *,
    host: str,
    port: int,
    token: str,
    instance: str | None = None,
    lease_grace_s: float = LEASE_GRACE_S,
    tool_wait_s: float = TOOL_WAIT_S,
    snapshot_root: str | os.PathLike[str] | None = None,
    wrap: Callable[[Asgi], Asgi] | None = None,
) -> None:
    """Serve ``hooks`` on ``host:port`` (0: any free port, named in the printed line) behind
    bearer ``token`` until SIGINT/SIGTERM. ``snapshot_root``: the only tree commit and
    restore may name (the run's snapshot root; None: any absolute path, with a warning).
    ``wrap``: ASGI middleware around the app (the reference environment's fault switches, for
    tests)."""
    # Imported here: the hooks' module may be imported without serving them.
    from rollsafe.env.participant import Participant
    from rollsafe.env.router import participant_app

    if not token:
        raise InvalidInput("an environment server needs a non-empty token")
    configure_tracing()  # spans per request go where OTEL_TRACES_EXPORTER says
    name = instance or default_instance(hooks.name)
    if snapshot_root is None:
        log.warning(
            "environment instance %s: commit and restore may name any absolute path; give "
            "it the run's snapshot root (--snapshot-root) to confine them",
            name,
        )
    participant = Participant(
        name,
        hooks,
        lease_grace_s=lease_grace_s,
        tool_wait_s=tool_wait_s,
        snapshot_root=snapshot_root,
    )
    app: Asgi = participant_app(participant, token)
    if wrap is not None:
        app = wrap(app)
    # lifespan on: the app's lifespan runs the participant's lease watcher from the start.
    await _Server(server_config(app, host, port, lifespan="on"), hooks.name, name).serve()
