"""ServedProcess: a server process the reference run and the tests start, stopped by pid."""

import os
import sys
from pathlib import Path

from rollsafe.http.served import ServedProcess


def test_a_served_process_runs_at_the_niceness_asked_and_stops_by_pid(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    server = ServedProcess(command, tmp_path / "logs", niceness=10)
    try:
        assert os.getpriority(os.PRIO_PROCESS, server.proc.pid) == 10
        assert os.getpriority(os.PRIO_PROCESS, 0) == ours  # the caller's is untouched
    finally:
        server.stop()
    assert not server.alive()
