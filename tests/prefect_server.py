"""One real Prefect server (the API, no UI) for the tests whose commands run Prefect flows. Not a test module.

Without ``PREFECT_API_URL`` every process that runs a flow (each `lifecycle run`, each background rollout
controller) starts Prefect's ephemeral server for itself: 15-30 s of imports and database migrations on 2
cores, paid again by every such process in the suite. Users who schedule runs point their commands at a
server the same way (`lifecycle server`); the tests that prove the ephemeral path (`make run` as a newcomer
types it, a signal during a run) leave this server out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from artifacts.common.net import free_port, wait_until_ready


@contextlib.contextmanager
def prefect_server(home: Path, timeout: float = 240.0) -> Iterator[str]:
    """A Prefect server on 127.0.0.1 with its own home and database; yields its API URL (``.../api``)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")} | {
        "PREFECT_HOME": str(home),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'server.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    home.mkdir(parents=True, exist_ok=True)
    log = home / "server.log"
    with open(log, "ab") as out:
        # the API alone, no background services: nothing here is scheduled, and no test reads what the services
        # keep (events, task runs recorded from events, late or cancelled runs); the suite's two cores are busy
        # enough without them
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                 "--port", str(port), "--no-ui", "--no-services"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    api = f"http://127.0.0.1:{port}/api"
    try:
        not_ready = wait_until_ready(f"{api}/health", timeout, alive=lambda: proc.poll() is None, interval=0.5)
        if not_ready is not None:
            raise AssertionError(f"{not_ready}\n{log.read_text(errors='replace')[-3000:]}")
        yield api
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
