"""The Ray actor behind one replica: it runs `lifecycle serve` on the node where Ray placed it.

Ray owns the replica's life: the actor reserves the replica's CPUs or GPU on its node, and is restarted by
Ray (``max_restarts``) when it dies. Its server is a child process, so the actor watches it: when the server
dies after it served, the actor exits, and Ray's restart starts a fresh server, on a new port or another node.
The server cannot outlive the actor either: it is started with the kernel's parent-death signal, so a killed
actor (``deploy stop``, a lost node) takes its server with it. Every time a server is ready the actor tells
each gateway where it answers (``PUT /admin/replicas/{name}``), and the gateway routes the new address
wherever the old one was. Runs on the cluster's nodes: imports only what `lifecycle serve` needs anyway.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from artifacts.common.net import answers_200
from artifacts.common.parent_death import die_with_parent
from serving.fleet.replica_backend import last_log_line

REGISTER_FOR_S = 600.0  # how long a started server keeps trying to reach a gateway that does not answer


def _server_process_setup() -> None:
    """In the child before exec: SIGKILL when the actor's process goes (Linux; elsewhere a no-op), and the
    default CPU priority. Ray runs its workers at niceness 15 (so its own daemons stay responsive); a server that
    inherited it would lose the cores to every other process on a busy node (measured here: TTFT p95 ×1.44 at 16
    streams). Raising the priority back needs root or CAP_SYS_NICE; without them the server keeps Ray's
    niceness (``info()["niceness"]``), and nodes started with ``RAY_worker_niceness=0`` avoid it."""
    die_with_parent()
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass


class ReplicaActor:
    """One `lifecycle serve` process on this node; the driver wraps this class with ``ray.remote``."""

    def __init__(self, name: str, serve_args: list[str], env: dict[str, str], log_dir: str, gateways: list[str],
                 admin_key: str) -> None:
        import ray

        self.name, self.gateways, self.admin_key = name, list(gateways), admin_key
        context = ray.get_runtime_context()
        self.restarted, self.node_id = context.was_current_actor_reconstructed, context.get_node_id()
        self.node = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((self.node, 0))
            port = probe.getsockname()[1]
        self.url = f"http://{self.node}:{port}"
        self.log = _log_file(log_dir, f"{name}-{port}.log")
        args = [sys.executable, "-m", "serving.cli", "serve", *serve_args, "--host", self.node, "--port", str(port)]
        with open(self.log, "ab") as handle:
            self.proc = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=os.environ | env, start_new_session=True, preexec_fn=_server_process_setup)
        self.ready = threading.Event()
        self.failure = ""
        self.stopping = False
        self.registered: list[str] = []
        threading.Thread(target=self._watch, name="replica-watch", daemon=True).start()

    def info(self) -> dict:
        return {"url": self.url, "pid": self.proc.pid, "node": self.node, "node_id": self.node_id, "log": str(self.log),
                "ready": self.ready.is_set(), "restarted": self.restarted, "registered": list(self.registered),
                "niceness": _niceness(self.proc.pid)}

    def wait_ready(self, timeout: float) -> str:
        """The URL once the server answers /ready; raises with the server's last log line when it cannot start."""
        deadline = time.monotonic() + timeout
        while not self.ready.is_set() and not self.failure and time.monotonic() < deadline:
            self.ready.wait(0.2)
        if self.ready.is_set():
            return self.url
        raise RuntimeError(self.failure or f"{self.url} did not answer in {timeout:.0f} s{last_log_line(self.log)}")

    def stop(self, grace: float) -> None:
        """Drain and stop the server (SIGTERM, SIGKILL after ``grace``); the driver then kills the actor."""
        self.stopping = True
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                return
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue

    # ----------------------------------------------------------------- the watch
    def _watch(self) -> None:
        while self.proc.poll() is None and not self.ready.is_set():
            if answers_200(self.url + "/ready", timeout=2.0):
                self.ready.set()
            else:
                time.sleep(0.2)
        if not self.ready.is_set():
            self.failure = f"{self.name}: the server exited with status {self.proc.returncode}{last_log_line(self.log)}"
            if self.restarted:  # a restart that cannot serve: let Ray try again, up to max_restarts
                os._exit(1)
            return  # a first start: the fleet reads the failure and stops this actor
        threading.Thread(target=self._register, name="replica-register", daemon=True).start()
        self.proc.wait()
        if not self.stopping:
            os._exit(1)  # the server died: Ray restarts this actor, which starts a new one

    def _register(self) -> None:
        """Tell every gateway where this replica answers, retrying while one is down or not started yet."""
        pending = list(self.gateways)
        deadline = time.monotonic() + REGISTER_FOR_S
        headers = {"authorization": f"Bearer {self.admin_key}", "x-lifecycle-actor": f"ray replica {self.name}"}
        while pending and time.monotonic() < deadline and not self.stopping:
            for gateway in list(pending):
                try:
                    answer = httpx.put(f"{gateway}/admin/replicas/{self.name}", json={"url": self.url},
                                       headers=headers, timeout=10)
                except httpx.HTTPError:
                    continue
                if answer.status_code == 200:
                    pending.remove(gateway)
                    self.registered.append(gateway)
            if pending:
                time.sleep(1.0)


def _niceness(pid: int) -> int | None:
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:
        return None


def _log_file(log_dir: str, name: str) -> Path:
    """The fleet's log directory where this node can write it (one machine, a shared disk), else the temp dir."""
    for directory in (Path(log_dir), Path(tempfile.gettempdir()) / "llm-lifecycle-replicas"):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            return directory / name
        except OSError:
            continue
    raise RuntimeError(f"{name}: no writable log directory on this node")
