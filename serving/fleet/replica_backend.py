"""Where a fleet's replicas run: the interface, and the local backend (one process per replica on this machine).

The fleet (``fleet.py``) decides what a replica serves and with which ``lifecycle serve`` flags; a backend
decides only where the process runs and how it is found, waited for and stopped. The local backend starts
detached processes on 127.0.0.1; the Ray backend (``ray_backend.py``) starts Ray actors that run the same
command on whichever node Ray places them. Nothing above the fleet knows which one runs: the controller and
the gateway see replica URLs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from artifacts.common.net import free_port, wait_until_ready
from serving.fleet.errors import FleetError
from serving.fleet.record import ReplicaRecord

SERVE = ["-m", "serving.cli", "serve"]  # after the Python that runs it
# several replicas (and the gateway) share a machine's cores: their OpenMP workers sleep at once instead of
# spinning against each other (serving.engine's default spins a little)
REPLICA_ENV = {"PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}


@dataclass
class ReplicaLaunch:
    """One replica to start: everything but where it runs and listens."""

    version: str
    bundle: str
    role: str
    served_model: str
    serve_args: list[str]  # after `lifecycle serve`: the bundle and every flag but --host and --port
    serve_flags: list[str] = field(default_factory=list)  # the user's part of serve_args, recorded as such
    threads: int | None = None  # torch threads: the CPUs a Ray replica asks for
    log_name: str = "replica.log"
    # where a replica that can come back elsewhere (a Ray actor) registers its address, with the fleet's admin key
    gateways: list[str] = field(default_factory=list)
    admin_key: str = ""


class ReplicaBackend(ABC):
    """Starts, finds and stops replicas; the fleet keeps the record."""

    name: str

    def connect(self) -> None:
        """Make sure the platform the replicas run on answers, before anything starts (FleetError if not)."""
        return None

    @abstractmethod
    def gateway_host(self) -> str:
        """The address the fleet's gateway listens on: replicas that register with it must reach it there."""

    @abstractmethod
    def start(self, launch: ReplicaLaunch) -> ReplicaRecord:
        """Start the replica and return its record at once, with its URL (the fleet waits for it)."""

    @abstractmethod
    def wait_ready(self, replica: ReplicaRecord, timeout: float) -> None:
        """Return once it answers /ready; raise FleetError with its last log line when it cannot start."""

    @abstractmethod
    def locate(self, replica: ReplicaRecord) -> str | None:
        """The URL it answers at now (a restarted Ray replica may have moved); None once it is gone for good."""

    @abstractmethod
    def stop(self, replica: ReplicaRecord, grace: float = 10) -> None:
        """Stop it: SIGTERM (the server drains), then SIGKILL after ``grace`` seconds."""

    def stop_strays(self, known: list[ReplicaRecord]) -> list[str]:
        """Stop replicas this fleet started but has no record of (a command killed between starting one and
        writing it down); returns their names."""
        return []


class LocalBackend(ReplicaBackend):
    """One detached process per replica on 127.0.0.1, its log under the fleet's ``logs``."""

    name = "local"

    def __init__(self, logs: Path) -> None:
        self.logs = logs

    def gateway_host(self) -> str:
        return "127.0.0.1"

    def start(self, launch: ReplicaLaunch) -> ReplicaRecord:
        port = free_port()
        args = [sys.executable, *SERVE, *launch.serve_args, "--port", str(port)]
        pid, log = spawn(args, self.logs / launch.log_name.replace(".log", f"-{port}.log"))
        return ReplicaRecord(launch.version, launch.bundle, f"http://127.0.0.1:{port}", pid, str(log),
                             launch.served_model, list(launch.serve_flags), launch.role)

    def wait_ready(self, replica: ReplicaRecord, timeout: float) -> None:
        wait_for(replica.url + "/ready", timeout, replica.pid, replica.log)

    def locate(self, replica: ReplicaRecord) -> str | None:
        return replica.url if pid_alive(replica.pid) else None

    def stop(self, replica: ReplicaRecord, grace: float = 10) -> None:
        terminate(replica.pid, grace)


def spawn(args: list[str], log: Path) -> tuple[int, Path]:
    """A detached process in its own session (so a stop reaches its children), output appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as handle:
        proc = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=os.environ | REPLICA_ENV, start_new_session=True)
    return proc.pid, log


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours is not alive
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def wait_for(url: str, timeout: float, proc_pid: int | None = None, log: str | Path | None = None) -> None:
    """Return once ``url`` answers 200; a process that exits first, or the timeout, raises with its last log line."""
    alive = None if proc_pid is None else (lambda: pid_alive(proc_pid))
    if wait_until_ready(url, timeout, alive=alive, interval=0.2) is None:
        return
    raise FleetError(f"{url} did not answer in {timeout:.0f} s{last_log_line(log)}")


def last_log_line(log: str | Path | None) -> str:
    """``"; last log line: ..."`` from a process log, or "" when there is none."""
    if not log or not Path(log).is_file():
        return ""
    lines = [ln for ln in Path(log).read_text(errors="replace").splitlines() if ln.strip()]
    return f"; last log line: {lines[-1][:300]}" if lines else ""


def terminate(pid: int | None, grace: float) -> None:
    """SIGTERM the process group, SIGKILL what is left after ``grace`` seconds."""
    if not pid_alive(pid):
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.1)
    if pid_alive(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
