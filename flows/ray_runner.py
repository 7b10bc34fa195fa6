"""Where the flow's stage tasks run: in the flow's own process (the default), or on a Ray cluster through
prefect-ray's `RayTaskRunner` (recipe `runner: {kind: ray, address: ...}`).

Why the flow holds the task runner itself instead of naming it in `@flow(task_runner=...)`: the recipe chooses,
and a run started by `lifecycle run`, by a scheduled deployment's worker or by a test reads the same recipe, so
each of them gets the runner its recipe names. On Ray every stage is one Ray task running the same Prefect task
(cached, retried, tracked in MLflow) in a Ray worker; a training stage asks Ray for one GPU per training
process when the cluster has GPUs (prefect-ray's `remote_options`), else one CPU per process, so it lands on a
node that can hold it. The workers reach the flow's Prefect API (the ephemeral one included) and its MLflow
store through the settings and environment given here; stages still hand each other directories, so every
node must see the workdir at the same path. Ray is imported only when a recipe asks for it, and its banners
and worker output stay out of the terminal (a worker's output is in Ray's session logs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

from artifacts.errors import ConfigError

NAMESPACE = "llm-lifecycle"  # the fleet's too: a pipeline whose rollout uses a Ray fleet shares this connection
START_HINT = "start one with `.venv/bin/ray start --head` (it prints the address), or set runner.address"


def resolve_address(address: str) -> str:
    """The recipe's address, else $RAY_ADDRESS, else `auto` (the cluster `ray start` began on this machine)."""
    return address or os.environ.get("RAY_ADDRESS") or "auto"


def check_address(address: str, where: str) -> None:
    """Fail in milliseconds, naming the key, when a HOST:PORT (or ray://HOST:PORT) address does not answer:
    `ray.init` would otherwise retry for a minute before it gives up."""
    if address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except ValueError:
        raise ConfigError(f"{where}: runner.address: {address!r} is not HOST:PORT, ray://HOST:PORT, auto or "
                          "local") from None
    except OSError as exc:
        raise ConfigError(f"{where}: runner.address: no Ray cluster answers at {address} "
                          f"({exc.strerror or type(exc).__name__}); {START_HINT}") from None


def connect(address: str, env: dict[str, str], where: str) -> None:
    """Join the cluster as a quiet driver whose tasks get `env` (MLflow and Prefect settings) in their workers."""
    check_address(address, where)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    try:
        ray.init(address=address, namespace=NAMESPACE, runtime_env={"env_vars": env}, log_to_driver=False,
                 logging_level=logging.ERROR, configure_logging=True, include_dashboard=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{where}: runner.address: no Ray cluster answers at {address} ({first[:200]}); "
                          f"{START_HINT}") from None


def largest_node() -> dict[str, float]:
    """The CPUs and GPUs of the cluster's biggest live node (a task's resources must fit on one node)."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    return {kind: max((n.get(kind, 0.0) for n in nodes), default=0.0) for kind in ("CPU", "GPU")}


def stage_resources(processes: int, device: str, key: str, where: str) -> dict[str, Any]:
    """What a training stage's task asks Ray for: a GPU per training process when its device may be CUDA and
    the cluster has GPUs (the launcher then runs one process per device), else a CPU per process. A request
    no node can hold is refused here, naming the key, instead of waiting in Ray's queue forever."""
    biggest = largest_node()
    kind = "GPU" if device != "cpu" and biggest["GPU"] > 0 else "CPU"
    if processes > biggest[kind]:
        raise ConfigError(f"{where}: {key}: {processes} processes need {processes} {kind}s on one Ray node; the "
                          f"largest node of the cluster has {biggest[kind]:g}")
    return {"num_gpus": processes} if kind == "GPU" else {"num_cpus": processes}


class LocalStages:
    """The default: Prefect runs each stage task in the flow's own process, where it is called."""

    kind = "local"

    def resources(self, processes: int, device: str, key: str) -> None:
        return None

    def run(self, task: Any, parameters: dict[str, Any], resources: dict[str, Any] | None = None) -> Any:
        return task(**parameters, return_state=True)


class RayStages:
    """Each stage task submitted to the Ray cluster; `run` waits for it and returns its final Prefect state."""

    kind = "ray"

    def __init__(self, runner: Any, api_url: str, where: str) -> None:
        self.runner = runner
        self.api_url = api_url
        self.where = where

    def resources(self, processes: int, device: str, key: str) -> dict[str, Any]:
        return stage_resources(processes, device, key, self.where)

    def run(self, task: Any, parameters: dict[str, Any], resources: dict[str, Any] | None = None) -> Any:
        from prefect.settings import PREFECT_API_URL, temporary_settings
        from prefect_ray.context import remote_options

        # The worker hydrates the settings serialized at submit time: give it the API this flow run talks to.
        with remote_options(**(resources or {})), temporary_settings(updates={PREFECT_API_URL: self.api_url}):
            future = self.runner.submit(task, parameters)
        future.wait()
        return future.state


@contextlib.contextmanager
def stage_runner(section: Any, tracking_uri: str, where: str) -> Iterator[LocalStages | RayStages]:
    """The runner the recipe's `runner:` section names, for the length of one flow run (call inside the flow)."""
    if section.kind == "local":
        yield LocalStages()
        return
    import ray
    from prefect.context import FlowRunContext
    from prefect_ray import RayTaskRunner

    from flows.environment import worker_environment

    owned = not ray.is_initialized()
    if owned:
        connect(resolve_address(section.address), worker_environment(tracking_uri), where)
    try:
        with RayTaskRunner() as runner:  # joins the connection made above
            yield RayStages(runner, str(FlowRunContext.get().client.api_url), where)
    finally:
        if owned:
            ray.shutdown()


def at_default_priority() -> None:
    """In a Ray worker, run the stage at niceness 0 again. Ray starts its workers at 15 (`worker_niceness`) to
    keep its daemons responsive, and a training stage (and the processes it launches) at 15 loses the cores to
    any other work on a shared node. Only root or CAP_SYS_NICE may lower it; elsewhere start the nodes with
    `RAY_worker_niceness=0`."""
    if ray_placement() and os.getpriority(os.PRIO_PROCESS, 0) > 0:
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, 0)


def ray_placement() -> dict[str, Any]:
    """Where this stage ran, when it ran as a Ray task (node, process, GPUs, niceness); empty elsewhere."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return {}
    context = ray.get_runtime_context()
    if context.worker.mode != ray.WORKER_MODE:
        return {}
    return {"ray_node": context.get_node_id(), "ray_pid": os.getpid(), "ray_gpus": [str(g) for g in ray.get_gpu_ids()],
            "ray_nice": os.getpriority(os.PRIO_PROCESS, 0)}
