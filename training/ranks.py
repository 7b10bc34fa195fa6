"""Who this process is in a distributed training stage: a worker or not, its rank, and what rank 0 alone does.

The launcher (training.launcher) starts each worker with the environment torch.distributed's `env://`
rendezvous reads (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), which is also what accelerate, and
so the Hugging Face Trainer, use to set up DDP or FSDP, plus `WORKER_ENV`, which says "this process is one of a
stage's workers, do not launch again". Outside a worker every helper answers as a lone process does.
"""

from __future__ import annotations

import os

WORKER_ENV = "LIFECYCLE_DISTRIBUTED_WORKER"
# the pid a worker dies with: its launcher, or the fork server it was forked from (training.worker_forkserver)
PARENT_PID_ENV = "LIFECYCLE_PARENT_PID"


def is_worker() -> bool:
    """True inside a process the launcher started (it trains its share and never launches workers itself)."""
    return os.environ.get(WORKER_ENV) == "1"


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1")) if is_worker() else 1


def rank() -> int:
    return int(os.environ.get("RANK", "0")) if is_worker() else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0")) if is_worker() else 0


def is_main_process() -> bool:
    """Rank 0: the one process that writes the adapter, merges, logs to MLflow and marks the stage done."""
    return rank() == 0


def cuda_device_index() -> int:
    """The GPU this process trains on: one process per device, rank `local_rank` on `cuda:{local_rank}`."""
    return local_rank()
