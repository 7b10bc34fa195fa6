"""The launcher's side of the worker fork server (training.worker_forkserver): start it once per process, ask it
for workers, and hold each worker by a handle that reads like `subprocess.Popen` (poll, wait, terminate, kill,
returncode), so the launcher treats forked and fresh workers alike."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from training.ranks import PARENT_PID_ENV
from training.worker_forkserver import receive, send

READY_TIMEOUT_SECONDS = 600.0  # the imports, on a host busy with other work
_server: ForkServer | None = None
_server_lock = threading.Lock()


class ForkServer:
    """One running `training.worker_forkserver` and the socket to it. Threads may share it (two stages of one
    flow at once): one lock around each exchange, and every exit notice is kept for whoever asks."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # what the libraries read once, at import: the workers' settings (training.launcher.worker_environment)
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid()), "TOKENIZERS_PARALLELISM": "false",
               "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
        self.process = subprocess.Popen([sys.executable, "-m", "training.worker_forkserver", str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.exit_codes: dict[int, int] = {}
        self._expect("ready", READY_TIMEOUT_SECONDS)

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, command: list[str], env: dict[str, str], name: str, stdout: int, stderr: int) -> int:
        """Start a worker running `command` (``[module, *argv]``, as after ``python -m``) with exactly `env`;
        return its pid."""
        request = {"module": command[0], "argv": command[1:], "env": {**env, PARENT_PID_ENV: str(self.process.pid)},
                   "cwd": os.getcwd(), "name": name}
        with self.lock:
            send(self.sock, {"fork": request}, [stdout, stderr])
            return self._expect("pid", 60.0)

    def exit_code(self, pid: int) -> int | None:
        with self.lock:
            self._drain()
            return self.exit_codes.get(pid)

    def signal(self, pid: int, signum: int) -> None:
        with self.lock:
            send(self.sock, {"signal": pid, "signum": int(signum)})

    def _expect(self, key: str, timeout: float) -> Any:
        """Read messages (keeping exit notices) until one carrying `key`; called with the lock held or alone."""
        deadline = time.monotonic() + timeout
        while True:
            self.sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                message, _ = receive(self.sock)
            except TimeoutError:
                if self.alive() and time.monotonic() < deadline:
                    continue
                message = None
            if message is None:
                raise RuntimeError(f"the training worker fork server (pid {self.process.pid}) stopped answering "
                                   f"(exit status {self.process.poll()})")
            if key in message:
                return message[key]
            self._keep(message)

    def _drain(self) -> None:
        self.sock.setblocking(False)
        try:
            while True:
                try:
                    message, _ = receive(self.sock)
                except BlockingIOError:
                    return
                if message is None:
                    return
                self._keep(message)
        finally:
            self.sock.setblocking(True)

    def _keep(self, message: dict) -> None:
        if "exited" in message:
            self.exit_codes[message["exited"]] = message["code"]


def fork_server() -> ForkServer:
    """This process's fork server, started on first use (and again if it died)."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            _server = ForkServer()
        return _server


class ForkedWorker:
    """A worker forked by the server, held like a `subprocess.Popen`."""

    def __init__(self, server: ForkServer, command: list[str], env: dict[str, str], name: str, stdout: int,
                 stderr: int) -> None:
        self.server = server
        self.pid = server.fork(command, env, name, stdout, stderr)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
            if self.returncode is None and not self.server.alive():
                self.returncode = -signal.SIGKILL  # the server died, and its workers with it
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def terminate(self) -> None:
        self.server.signal(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        self.server.signal(self.pid, signal.SIGKILL)
