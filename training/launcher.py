"""Start a training stage's N worker processes on this host, wait for them, and turn a failure into one error.

Why our own ten-line spawn rather than `accelerate launch` or `torchrun` in a subprocess: a stage is called from
a Prefect task thread, a Ray worker, a CLI and pytest alike, and each worker here is a plain child of that
caller. It gets the `env://` rendezvous variables torch.distributed reads (what torchrun would set, and what
accelerate and so the Hugging Face Trainer use to build DDP or FSDP), dies with the process that started it
(a stage killed mid-run must leave no orphans training on, so that its re-run resumes from the checkpoint
alone), and reports a user error in its own words, not as a launcher's stack of tracebacks. What the workers
run is `python -m training.distributed_worker JOB` (training/distributed_worker.py). On CPU (Linux) the workers
are forked from this process's worker fork server (training/worker_forkserver.py), which imported the training
libraries once: a fresh worker paid ~17 s of CPU in imports before its first step, once per rank and stage.

Rank 0 writes to this process's terminal (its progress bar is the stage's); every other rank writes
`<log_dir>/rank-<r>.log`, which a failure names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from artifacts.common.atomic import atomic_write_json
from artifacts.common.net import free_port
from training.distributed_config import DistributedSettings
from training.forked_workers import ForkedWorker, fork_server
from training.ranks import PARENT_PID_ENV, WORKER_ENV
from training.stage_config import TrainingError

JOB_FILE = "job.json"
WORKER_MODULE = "training.distributed_worker"  # run by name, as `python -m` runs it: the worker runs the stages
STOP_GRACE_SECONDS = 10.0
Worker = subprocess.Popen | ForkedWorker


def error_file(log_dir: Path, rank: int) -> Path:
    """Where a worker that fails writes what went wrong ({type, message, user_error})."""
    return Path(log_dir) / f"error-rank-{rank}.json"


def check_devices(settings: DistributedSettings, device: str) -> None:
    """Refuse, before anything starts, a layout the machine cannot run: more CUDA processes than GPUs (one
    process per device), or FSDP on CPU processes.

    Why FSDP is refused on CPU: accelerate (1.15) builds FSDP only when the processes are GPU-class; for CPU
    processes it sets up plain DDP and says nothing, so `strategy: fsdp` would train unsharded while the recipe
    claims otherwise (tried: the Trainer's wrapped model was DistributedDataParallel)."""
    if device != "cuda":
        if settings.strategy == "fsdp":
            raise TrainingError("distributed.strategy: fsdp needs one GPU per process; accelerate shards only GPU "
                                "processes (on CPU it would quietly train ddp), so use strategy: ddp on this machine")
        return
    import torch

    count = torch.cuda.device_count()
    if settings.num_processes > count:
        raise TrainingError(f"distributed.num_processes: {settings.num_processes} processes need as many GPUs (one "
                            f"process per device), and this machine has {count}")


def _threads_per_process(n: int) -> int:
    """CPU workers share the cores: without a limit each would start one thread per core and they would fight."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // n)


def worker_environment(rank: int, settings: DistributedSettings, port: int, device: str) -> dict[str, str]:
    """The environment of worker `rank`: torch.distributed's env:// variables, the MLflow run rank 0 logs into,
    thread limits on CPU, and the markers that make it a worker."""
    n = settings.num_processes
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
           "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           WORKER_ENV: "1", PARENT_PID_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
    if device == "cpu":
        threads = os.environ.get("LIFECYCLE_TORCH_THREADS") or str(_threads_per_process(n))
        env.update(OMP_NUM_THREADS=threads, LIFECYCLE_TORCH_THREADS=threads)
    env.update(_mlflow_target())
    return env


def _mlflow_target() -> dict[str, str]:
    """The caller's active MLflow run (the flow's stage run), so rank 0 logs into it by id."""
    import mlflow

    run = mlflow.active_run()
    if run is None:
        return {}
    return {"MLFLOW_RUN_ID": run.info.run_id, "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri()}


def launch_workers(job: dict[str, Any], settings: DistributedSettings, device: str, log_dir: Path,
                   label: str) -> None:
    """Run `job` (see training.distributed_worker) in `settings.num_processes` processes; return when all
    exit 0. A worker that fails stops the others and raises: the worker's own TrainingError for a user error,
    else a RuntimeError naming the rank, the error and its log."""
    check_devices(settings, device)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    for stale in log_dir.glob("error-rank-*.json"):
        stale.unlink()
    job_path = log_dir / JOB_FILE
    atomic_write_json(job_path, {**job, "log_dir": str(log_dir)})
    port = free_port()
    workers: list[Worker] = []
    logs = []
    try:
        for rank in range(settings.num_processes):
            out = None  # rank 0 on the terminal: its progress bar is the stage's
            if rank:
                out = open(log_dir / f"rank-{rank}.log", "wb")  # noqa: SIM115 - closed in finally
                logs.append(out)
            env = worker_environment(rank, settings, port, device)
            workers.append(_start_worker(job_path, env, device, f"{label}-rank{rank}", out))
        failed = _wait(workers)
    finally:
        _stop(workers)
        for log in logs:
            log.close()
    if failed:
        rank = _root_cause(failed, log_dir)
        raise _failure(rank, workers[rank].returncode, settings.num_processes, log_dir, label)


def _start_worker(job_path: Path, env: dict[str, str], device: str, name: str, out: Any) -> Worker:
    """A worker forked from the fork server (CPU on Linux), else a fresh `python -m training.distributed_worker`
    (CUDA: a forked child cannot use CUDA safely, and the import is small beside a GPU step)."""
    command = [WORKER_MODULE, str(job_path)]
    if device == "cpu" and sys.platform.startswith("linux"):
        stdout, stderr = (out.fileno(), out.fileno()) if out is not None else (1, 2)
        return ForkedWorker(fork_server(), command, env, name, stdout, stderr)
    return subprocess.Popen([sys.executable, "-m", *command], env=env, stdout=out, stderr=out)


def _wait(workers: list[Worker]) -> list[int]:
    """Poll until every worker has exited 0 (no ranks) or some have failed (their ranks)."""
    while True:
        codes = [w.poll() for w in workers]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed or all(code == 0 for code in codes):
            return failed
        time.sleep(0.2)


def _read_error(log_dir: Path, rank: int) -> dict | None:
    try:
        return json.loads(error_file(log_dir, rank).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _root_cause(failed: list[int], log_dir: Path) -> int:
    """Of ranks that failed together, the one that says most: a user error; else one that died without a word
    (a signal, the OOM killer), whose peers' recorded errors are only the broken connection to it; else the
    lowest rank."""
    errors = {rank: _read_error(log_dir, rank) for rank in failed}
    for wanted in (lambda e: e is not None and e.get("user_error"), lambda e: e is None):
        for rank in failed:
            if wanted(errors[rank]):
                return rank
    return failed[0]


def _stop(workers: list[Worker]) -> None:
    """Terminate whoever still runs (the peers of a failed worker block in a collective), then kill."""
    for worker in workers:
        if worker.poll() is None:
            worker.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for worker in workers:
        try:
            worker.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def _failure(rank: int, code: int, n: int, log_dir: Path, label: str) -> Exception:
    where = f"{label}: worker rank {rank} of {n}"
    log = log_dir / f"rank-{rank}.log"
    error = _read_error(log_dir, rank)
    if error is None:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return RuntimeError(f"{where} {how} (log: {log if rank else 'the output above'})")
    if error.get("user_error"):
        return TrainingError(error["message"])
    return RuntimeError(f"{where} failed: {error['type']}: {error['message']} (log: {log})")
