"""The Ray backend: each replica is a detached, named Ray actor (``ray_replica.py``) that runs `lifecycle serve`
on the node where Ray places it, with the CPUs or the GPU that replica needs reserved.

Detached and named in the fleet's namespace, the actors outlive the command that started them, and a later
``deploy`` command (``status``, ``stop``, the rollout's retirement of old replicas) finds them by name. Ray
restarts a replica whose server or node died; the restarted actor tells the gateways its new address.
Imported only when a fleet's backend is ``ray``: nothing else in the project imports Ray.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from pathlib import Path

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayError

from serving.fleet.errors import FleetError
from serving.fleet.ray_replica import ReplicaActor
from serving.fleet.record import ReplicaRecord
from serving.fleet.replica_backend import REPLICA_ENV, ReplicaBackend, ReplicaLaunch

DEFAULT_NAMESPACE = "llm-lifecycle"
MAX_RESTARTS = 10  # a replica that keeps dying is left dead after this many restarts (the gateway ejects it)
PLACE_TIMEOUT_S = 120.0  # how long a replica may wait for a node with its resources free
LOCATE_TIMEOUT_S = 60.0  # how long to wait for a restarting replica to say where it answers
START_HINT = "start one with `ray start --head --port=6379` (README: Commands), or pass --ray-address HOST:PORT"


def connect(address: str, namespace: str) -> None:
    """Join the cluster at ``address`` as a quiet driver (no worker logs or banners on this terminal)."""
    if ray.is_initialized():
        return
    if address not in ("auto", "local") and not address.startswith("ray://"):
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
        except (OSError, ValueError) as exc:
            reason = exc.strerror or type(exc).__name__ if isinstance(exc, OSError) else f"not HOST:PORT ({exc})"
            raise FleetError(f"no Ray cluster answers at {address} ({reason}); {START_HINT}") from None
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.ERROR,
                 configure_logging=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FleetError(f"no Ray cluster answers at {address} ({message[:200]}); {START_HINT}") from None


def replica_resources(serve_args: list[str], threads: int | None, cluster_gpus: float) -> tuple[dict, list[str]]:
    """What one replica asks Ray for, and the ``--device`` it then serves on: a GPU when its device is cuda
    (or ``auto`` on a cluster that has GPUs), else ``threads`` CPUs (at least one)."""
    device = _flag(serve_args, "--device") or "auto"
    wants_gpu = device.startswith("cuda") or (device == "auto" and cluster_gpus > 0)
    device_flag = ["--device", "cuda" if wants_gpu else "cpu"] if device == "auto" else []
    return {"num_cpus": max(1, threads or 1), "num_gpus": 1 if wants_gpu else 0}, device_flag


def _flag(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


class RayBackend(ReplicaBackend):
    name = "ray"

    def __init__(self, address: str, namespace: str, fleet_id: str, logs: Path) -> None:
        self.address, self.namespace, self.fleet_id, self.logs = address, namespace, fleet_id, logs
        self._handles: dict[str, object] = {}

    def connect(self) -> None:
        connect(self.address, self.namespace)

    def gateway_host(self) -> str:
        self.connect()
        return ray.util.get_node_ip_address()  # this machine as the cluster's nodes reach it

    def start(self, launch: ReplicaLaunch) -> ReplicaRecord:
        self.connect()
        resources, device_flag = replica_resources(launch.serve_args, launch.threads,
                                                   ray.cluster_resources().get("GPU", 0))
        role = f"-{launch.role}" if launch.role else ""
        name = f"{self.fleet_id}-v{launch.version}{role}-{uuid.uuid4().hex[:6]}"
        remote = ray.remote(ReplicaActor).options(
            name=name, namespace=self.namespace, lifetime="detached", max_restarts=MAX_RESTARTS,
            max_concurrency=4, **resources)
        actor = remote.remote(name, [*launch.serve_args, *device_flag], REPLICA_ENV, str(self.logs),
                              launch.gateways, launch.admin_key)
        self._handles[name] = actor
        try:
            info = ray.get(actor.info.remote(), timeout=PLACE_TIMEOUT_S)
        except GetTimeoutError:
            ray.kill(actor, no_restart=True)
            raise FleetError(f"Ray placed no replica of v{launch.version} in {PLACE_TIMEOUT_S:.0f} s: it asks for "
                               f"{resources}, the cluster has {_free()} free") from None
        except RayError as exc:
            ray.kill(actor, no_restart=True)
            raise FleetError(f"the replica of v{launch.version} could not start on Ray: {_first_line(exc)}") \
                from None
        return ReplicaRecord(launch.version, launch.bundle, info["url"], info["pid"], f"{info['node']}:{info['log']}",
                             launch.served_model, list(launch.serve_flags), launch.role, actor=name, node=info["node"])

    def wait_ready(self, replica: ReplicaRecord, timeout: float) -> None:
        try:
            ray.get(self._handle(replica).wait_ready.remote(timeout), timeout=timeout + 30)
        except (RayError, ValueError) as exc:
            raise FleetError(f"{replica.url} (Ray actor {replica.actor}): {_first_line(exc)}") from None

    def locate(self, replica: ReplicaRecord) -> str | None:
        deadline = time.monotonic() + LOCATE_TIMEOUT_S
        while True:
            try:
                info = ray.get(self._handle(replica).info.remote(), timeout=LOCATE_TIMEOUT_S)
            except ActorUnavailableError:  # restarting: ask again until it is back
                if time.monotonic() > deadline:
                    return replica.url
                time.sleep(0.5)
                continue
            except (ActorDiedError, ValueError):  # stopped, out of restarts, or never known to this cluster
                return None
            except GetTimeoutError:
                return replica.url
            replica.pid, replica.node = info["pid"], info["node"]
            replica.log = f"{info['node']}:{info['log']}"
            return info["url"]

    def stop(self, replica: ReplicaRecord, grace: float = 10) -> None:
        try:
            handle = self._handle(replica)
        except ValueError:
            return  # gone already
        try:
            ray.get(handle.stop.remote(grace), timeout=grace + 15)
        except RayError:
            pass  # dead or stuck: the kill below ends it, and its server dies with it
        ray.kill(handle, no_restart=True)
        self._handles.pop(replica.actor, None)

    def stop_strays(self, known: list[ReplicaRecord]) -> list[str]:
        self.connect()
        names = {r.actor for r in known}
        strays = [n for n in ray.util.list_named_actors() if n.startswith(self.fleet_id + "-") and n not in names]
        for name in strays:
            self.stop(ReplicaRecord("", "", "", 0, "", "", actor=name), grace=5)
        return strays

    def _handle(self, replica: ReplicaRecord):
        """The actor's handle, found by name in the fleet's namespace (ValueError when there is none)."""
        self.connect()
        if replica.actor not in self._handles:
            self._handles[replica.actor] = ray.get_actor(replica.actor, namespace=self.namespace)
        return self._handles[replica.actor]


def _free() -> dict:
    return {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}


def _first_line(exc: BaseException) -> str:
    """A Ray error's cause in one line: the replica's own message where there is one."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    lines = [ln for ln in text if ln.strip() and not ln.startswith(("Traceback", "  "))]
    return (lines[-1] if lines else type(cause).__name__)[:400]
