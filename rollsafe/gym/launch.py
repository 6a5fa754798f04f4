"""Run one NeMo Gym server, unmodified, as its own process: ``launch.py <server dir>``.

This file runs under a NeMo Gym venv's Python (``.venv-gym``: 3.13; ``.venv-gym-0.4``: 3.12),
where rollsafe is not installed: it imports only the standard library and ``nemo_gym``. rollsafe's
:mod:`rollsafe.gym.servers` starts it; by hand::

    NEMO_GYM_CONFIG_DICT='<the whole resolved config, YAML or JSON>' \\
    NEMO_GYM_CONFIG_PATH=workplace_assistant \\
    .venv-gym/bin/python rollsafe/gym/launch.py resources_servers/workplace_assistant

What it does around ``python app.py`` (what ``ng_run`` runs for each server):

- ``nemo_gym.server_utils.initialize_ray`` becomes a no-op. Without ``ray_head_node_address`` in
  the config every server would start a whole local Ray cluster (~10 s, ~1.7 GB); the servers
  rollsafe runs (workplace_assistant, simple_agent) never use Ray.
- It changes into the server's directory inside site-packages and runs its ``app.py`` as
  ``__main__``, as ``ng_run`` does.
- Once the server answers ``GET /`` (nemo_gym's liveness route) it prints one line on stdout,
  ``nemo-gym serving <section> on http://HOST:PORT`` (:data:`BANNER`), for its starter to wait
  for. uvicorn's own "Uvicorn running on ..." goes to stderr, prefixed by nemo_gym, and comes
  before the app answers.
- When ``ROLLSAFE_PARENT_PID`` names its starter, it SIGTERMs itself once that process ends
  (as rollsafe's own servers do, :mod:`rollsafe.children`), so a starter killed from outside
  leaves no server behind.
"""

from __future__ import annotations

import http.client
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

BANNER = "nemo-gym serving {section} on http://{host}:{port}"
PARENT_PID_ENV = "ROLLSAFE_PARENT_PID"
EXIT_GRACE_S = 10.0  # after the SIGTERM a parent's death sends, before exiting outright


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: launch.py <server dir, e.g. resources_servers/workplace_assistant>")
    section = os.environ.get("NEMO_GYM_CONFIG_PATH")
    if not section or not os.environ.get("NEMO_GYM_CONFIG_DICT"):
        sys.exit("launch.py needs NEMO_GYM_CONFIG_DICT and NEMO_GYM_CONFIG_PATH in its environment")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    # Not this file's directory on sys.path (its neighbours are rollsafe's, for Python 3.11).
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(here)]

    import nemo_gym  # type: ignore[import-not-found]
    import nemo_gym.server_utils as server_utils  # type: ignore[import-not-found]
    from nemo_gym.global_config import (  # type: ignore[import-not-found]
        get_first_server_config_dict,
        get_global_config_dict,
    )

    server_utils.initialize_ray = _no_ray  # app.py calls it through the module: no cluster

    server_dir = nemo_gym.PARENT_DIR / argv[1]
    app = server_dir / "app.py"
    if not app.is_file():
        sys.exit(f"launch.py: no NeMo Gym server at {server_dir} (no app.py)")
    config = get_first_server_config_dict(get_global_config_dict(), section)
    host, port = str(config["host"]), int(config["port"])

    _watch_parent()
    threading.Thread(
        target=_announce, args=(section, host, port), name="nemo-gym-banner", daemon=True
    ).start()

    os.chdir(server_dir)  # as `cd <server dir> && python app.py`
    sys.path.insert(0, str(server_dir))
    sys.argv = [str(app)]
    runpy.run_path(str(app), run_name="__main__")


def _no_ray() -> None:
    print("rollsafe launch.py: Ray not started (initialize_ray is a no-op here)")


def _announce(section: str, host: str, port: int) -> None:
    """Print the banner once the app answers its liveness route. Written on fd 1 directly:
    nemo_gym prefixes sys.stdout's lines with the server name."""
    while not _answers(host, port):
        time.sleep(0.05)
    line = BANNER.format(section=section, host=host, port=port) + "\n"
    os.write(1, line.encode())


def _answers(host: str, port: int) -> bool:
    connection = http.client.HTTPConnection(host, port, timeout=2)
    try:
        connection.request("GET", "/")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def _watch_parent() -> None:
    value = os.environ.pop(PARENT_PID_ENV, None)
    if value is not None:
        threading.Thread(
            target=_end_with, args=(int(value),), name="nemo-gym-parent-watch", daemon=True
        ).start()


def _end_with(parent: int) -> None:
    try:
        pidfd = os.pidfd_open(parent)
    except ProcessLookupError:
        pass
    except (AttributeError, OSError):  # no pidfds: poll
        while _alive(parent):
            time.sleep(0.5)
    else:
        import select

        select.select([pidfd], [], [])
        os.close(pidfd)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful stop
    time.sleep(EXIT_GRACE_S)
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    main(sys.argv)
