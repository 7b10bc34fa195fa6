"""`python -m training.distributed_worker JOB`: one worker process of a distributed training stage.

The launcher (training.launcher) starts N of these with torch.distributed's env:// variables set; each reads
the job file and runs the same stage function a single process would (`training.finetune_stage.run_finetune_stage`
for SFT, DPO and GRPO, `training.draft.build_draft` for the draft), which sees it is a worker (training.ranks)
and trains its share: the Hugging Face Trainer, or the draft's accelerate loop, builds DDP or FSDP from the
environment, and rank 0 alone writes the outputs. A failure is written to `error-rank-<r>.json` for the launcher
to report; a user error (a LifecycleError) is one line, not a traceback.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from artifacts.errors import LifecycleError

# stage name → (module, spec attribute, config class in training.stage_config)
STAGES = {"sft": ("training.sft", "SFT_SPEC", "SFTStageConfig"),
          "dpo": ("training.dpo", "DPO_SPEC", "DPOStageConfig"),
          "grpo": ("training.grpo", "GRPO_SPEC", "GRPOStageConfig")}


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the process that launched it (or the fork server it was forked from)
    dies: a killed stage must not leave workers training on beside its re-run."""
    from artifacts.common.parent_death import die_with_parent
    from training.ranks import PARENT_PID_ENV

    parent = os.environ.get(PARENT_PID_ENV)
    die_with_parent(int(parent) if parent else None)


def run_job(job: dict[str, Any]) -> None:
    """Run the stage or draft the job names, with its arguments, as this rank's share."""
    if job["kind"] == "stage":
        module, spec_name, config_name = STAGES[job["stage"]]
        from training import stage_config
        from training.finetune_stage import run_finetune_stage

        spec = getattr(importlib.import_module(module), spec_name)
        config = getattr(stage_config, config_name)(**job["config"])
        run_finetune_stage(spec, config, Path(job["model_dir"]), Path(job["data_dir"]), Path(job["output_dir"]))
    elif job["kind"] == "draft":
        from training.draft import build_draft
        from training.draft_config import DraftConfig

        texts = json.loads(Path(job["texts_file"]).read_text(encoding="utf-8"))
        build_draft(job["target_dir"], job["out_dir"], DraftConfig(**job["config"]), texts,
                    overwrite=job["overwrite"])
    else:
        raise ValueError(f"unknown job kind {job['kind']!r}")


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    from artifacts.common.quiet import quiet_warnings
    from training.launcher import error_file
    from training.ranks import rank

    quiet_warnings()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    job = json.loads(Path((argv or sys.argv[1:])[0]).read_text(encoding="utf-8"))
    try:
        run_job(job)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the launcher
        user_error = isinstance(exc, LifecycleError)
        error = {"type": type(exc).__name__, "message": str(exc), "user_error": user_error}
        error_file(Path(job["log_dir"]), rank()).write_text(json.dumps(error), encoding="utf-8")
        print(f"error: {exc}" if user_error else traceback.format_exc(), file=sys.stderr)
        return 1
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
