"""A real Ray cluster on this machine for the Ray fleet tests and benchmark: a head and a second node, each a
`ray start --block` process with its own temp dir, CPUs and a custom resource. Not a test module.

``--block`` keeps each node's Ray processes children of one process, so stopping that process (SIGTERM) takes
them all down: nothing else on the machine (another cluster, another session's) is touched, as ``ray stop``
would. Every port Ray would otherwise take by default (client server, dashboard, agents) is a free one, so
two clusters can run side by side. Ray resolves 127.0.0.1 to this host's own address (192.0.2.2 here) when
it names a node; the cluster still never leaves this machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from artifacts.common.net import free_port

RAY = str(Path(sys.executable).with_name("ray"))
QUIET = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1"}


@dataclass
class RayCluster:
    address: str  # HOST:PORT of the head's GCS, as `ray start --address` and `ray.init(address=...)` take it
    temp: Path
    pids: list[int]  # the `ray start --block` processes: every Ray process of the cluster descends from one


def _node(args: list[str], temp: Path, name: str) -> subprocess.Popen:
    log = open(temp / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it until the cluster stops
    ports = ["--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
             "--dashboard-agent-grpc-port", str(free_port()), "--metrics-export-port", str(free_port()),
             "--object-store-memory", str(100 * 1024 * 1024)]
    return subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", f"--temp-dir={temp / name}",
                             *args, *ports], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=os.environ | QUIET, start_new_session=True)


class _SlowStart(AssertionError):
    """A node gave up registering with the head: `ray start` waits a fixed 30 s for that (node.py), which a
    loaded 2-core machine can miss. Starting the cluster again is the cure, not a longer wait."""


def _node_exited(proc: subprocess.Popen, name: str, temp: Path) -> AssertionError:
    log = (temp / f"{name}.log").read_text(errors="replace")
    kind = _SlowStart if "timed out during startup" in log else AssertionError
    return kind(f"ray {name} exited: {log[-2000:]}")


def _wait_nodes(address: str, count: int, procs: list[subprocess.Popen], temp: Path, timeout: float) -> None:
    """Until ``ray status`` lists ``count`` alive nodes (a node process that exits first fails at once)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc, name in zip(procs, ("head", "node")):
            if proc.poll() is not None:
                raise _node_exited(proc, name, temp)
        status = subprocess.run([RAY, "status", f"--address={address}"], capture_output=True, text=True,
                                env=os.environ | QUIET, timeout=60)
        if status.returncode == 0 and status.stdout.count(" node_") >= count:
            return
        time.sleep(1.0)
    raise AssertionError(f"the Ray cluster at {address} never had {count} nodes")


def _start(head_cpus: int, node_cpus: int, temp: Path, timeout: float, procs: list[subprocess.Popen]) -> str:
    """Start the head (and the second node) into ``procs``; the head's GCS address once every node is up."""
    procs.append(_node(["--head", f"--port={free_port()}", "--node-ip-address=127.0.0.1",
                        f"--num-cpus={head_cpus}", '--resources={"head": 1}', "--include-dashboard=false",
                        f"--dashboard-port={free_port()}"], temp, "head"))
    address = _head_address(procs[0], temp, timeout)
    _wait_nodes(address, 1, procs, temp, timeout)
    if node_cpus:
        procs.append(_node([f"--address={address}", f"--num-cpus={node_cpus}", '--resources={"node2": 1}'],
                           temp, "node"))
        _wait_nodes(address, 2, procs, temp, timeout)
    return address


@contextlib.contextmanager
def ray_cluster(head_cpus: int = 3, node_cpus: int = 2, timeout: float = 180.0,
                attempts: int = 3) -> Iterator[RayCluster]:
    """A head (``head_cpus`` CPUs, resource ``head``) and a second node (``node_cpus``, resource ``node2``; none
    when 0). A node that times out registering is started again with a fresh cluster, ``attempts`` times."""
    for attempt in range(1, attempts + 1):
        # short: Ray's unix sockets live below it, and a socket path may not exceed 107 characters
        temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        procs: list[subprocess.Popen] = []
        try:
            try:
                address = _start(head_cpus, node_cpus, temp, timeout, procs)
            except _SlowStart:
                if attempt == attempts:
                    raise
                continue  # the finally below stops what did start
            yield RayCluster(address, temp, [p.pid for p in procs])
            return
        finally:
            for proc in reversed(procs):
                _stop(proc)
            shutil.rmtree(temp, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the node's processes on its way out
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _head_address(head: subprocess.Popen, temp: Path, timeout: float) -> str:
    """The GCS address the head wrote down once up (Ray names this host by its routable address, not 127.0.0.1)."""
    written = temp / "head" / "ray_current_cluster"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and head.poll() is None:
        if written.is_file() and written.read_text().strip():
            return written.read_text().strip()
        time.sleep(0.3)
    if head.poll() is not None:
        raise _node_exited(head, "head", temp)
    raise AssertionError(f"the Ray head never came up: {(temp / 'head.log').read_text()[-2000:]}")
