"""Training stages in two gloo processes under accelerate (real processes, real DDP): the model one process
trains, rank 0 alone writing, kill-and-resume, the draft, and a worker's error as the stage's error."""

from __future__ import annotations

import json
import textwrap
import time

import mlflow
import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from stage_kill import kill_at_first_checkpoint  # tests/training/stage_kill.py

from training.checkpoints import FINISHED_MARKER
from training.draft import DRAFT_RECORD, build_draft
from training.draft_config import DraftConfig
from training.finetune_stage import WORKER_LOGS_DIR
from training.heldout_curve import METRIC as HELDOUT_METRIC
from training.sft import run_sft
from training.stage_config import LoraSettings, SFTStageConfig, TrainingError

# Measured on the micro model (2 CPU cores): per-step losses of 1 and 2 processes agree to ~1e-6 and the
# adapters to ~4e-7 (the same examples per optimizer step; only the order of float sums differs).
LOSS_TOLERANCE = 1e-4
WEIGHT_TOLERANCE = 1e-5


STEPS = 24


def sft(processes: int, **overrides) -> SFTStageConfig:
    values = dict(max_steps=STEPS, batch_size=8, learning_rate=5e-3, save_steps=2, logging_steps=1, seed=3,
                  lora=LoraSettings(r=4, alpha=8), heldout_curve_prompts=4, heldout_curve_every=12,
                  distributed={"num_processes": processes})
    values.update(overrides)
    return SFTStageConfig(**values)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def losses(result) -> list[tuple[int, float]]:
    return [(row["step"], row["loss"]) for row in result.log_history if "loss" in row]


def workers_of(stage_pid: int) -> list[psutil.Process]:
    """The stage's worker processes (named `sft-rank<r>` by the fork server they were forked from)."""
    return [proc for proc in psutil.Process(stage_pid).children(recursive=True) if proc.name().startswith("sft-rank")]


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[4])
    from test_distributed import sft
    from training.sft import run_sft
    run_sft(sft(2), sys.argv[1], sys.argv[2], sys.argv[3])
""")


@pytest.mark.slow
def test_two_gloo_processes_killed_and_resumed_train_the_model_one_process_trains(micro_base_dir, micro_data_dir,
                                                                                  tmp_path):
    one = run_sft(sft(1), micro_base_dir, micro_data_dir, tmp_path / "one")

    # two processes, their stage process SIGKILLed after a checkpoint: the workers die with it
    out = tmp_path / "two"
    left_behind: list[psutil.Process] = []

    def both_workers_run(stage_pid: int) -> None:
        assert len(workers_of(stage_pid)) == 2
        left_behind.extend(psutil.Process(stage_pid).children(recursive=True))  # the workers and their fork server

    killed_at = kill_at_first_checkpoint(CHILD, [str(micro_base_dir), str(micro_data_dir), str(out)], out, tmp_path,
                                         timeout=240, before_kill=both_workers_run)
    deadline = time.monotonic() + 30
    while [proc for proc in left_behind if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, "workers outlived their stage process"
        time.sleep(0.2)
    assert 2 <= killed_at < STEPS and not (out / FINISHED_MARKER).exists()

    # ... and the re-run resumes from that checkpoint, rank 0 alone logging into the caller's MLflow run
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        with mlflow.start_run() as run:
            two = run_sft(sft(2), micro_base_dir, micro_data_dir, out)
        logged = MlflowClient().get_metric_history(run.info.run_id, "train/loss")
        params = MlflowClient().get_run(run.info.run_id).data.params
    finally:
        mlflow.set_tracking_uri(None)
    assert two.resumed_from_step == killed_at and not two.skipped

    # batch_size is the global batch: each step the two processes take the examples one process takes, so
    # the losses step by step and the trained weights are one process's, up to the order of float sums
    assert [s for s, _ in losses(two)] == [s for s, _ in losses(one)] == list(range(1, STEPS + 1))
    assert max(abs(a - b) for (_, a), (_, b) in zip(losses(one), losses(two))) < LOSS_TOLERANCE
    adapters = [load_file(str(r.adapter_dir / "adapter_model.safetensors")) for r in (one, two)]
    assert max_difference(*adapters) < WEIGHT_TOLERANCE
    merged = [load_file(str(r.output_dir / "model.safetensors")) for r in (one, two)]
    assert max_difference(*merged) < WEIGHT_TOLERANCE
    curve = [[row[HELDOUT_METRIC] for row in r.log_history if HELDOUT_METRIC in row] for r in (one, two)]
    assert len(curve[1]) >= 2 and curve[1][-1] == curve[0][-1]

    # rank 0 alone wrote: one completion marker, one MLflow record (not one row per process)
    assert (out / FINISHED_MARKER).is_file() and not (out / "checkpoints").exists()
    assert len(logged) == len(losses(two)) and params["sft.distributed.num_processes"] == "2"
    assert (out / WORKER_LOGS_DIR / "rank-1.log").is_file()
    assert not list((out / WORKER_LOGS_DIR).glob("error-rank-*.json"))

    # the process count is not part of the recipe: the stage is done, whoever asks again
    again = run_sft(sft(1), micro_base_dir, micro_data_dir, out)
    assert again.skipped and again.metrics == two.metrics


@pytest.mark.slow
def test_two_process_draft_distills_the_draft_one_process_does(micro_base_dir, tmp_path):
    def config(processes: int) -> DraftConfig:
        return DraftConfig(steps=10, batch_size=8, seq_len=64, eval_tokens=512,
                           distributed={"num_processes": processes})

    one = build_draft(micro_base_dir, tmp_path / "one", config(1))
    two = build_draft(micro_base_dir, tmp_path / "two", config(2))
    records = [json.loads((d / DRAFT_RECORD).read_text())["distillation"] for d in (one.path, two.path)]
    assert max(abs(a - b) for a, b in zip(records[0]["loss"], records[1]["loss"])) < LOSS_TOLERANCE
    weights = [load_file(str(d / "model.safetensors")) for d in (one.path, two.path)]
    assert max_difference(*weights) < WEIGHT_TOLERANCE
    assert two.agreement == pytest.approx(one.agreement, abs=0.01) and two.text_source == one.text_source
    assert (tmp_path / ".two.workers" / "rank-1.log").is_file()


def test_a_worker_error_is_the_stage_error(tmp_path):
    """A user error raised in a worker is the stage's own TrainingError; anything else names the rank."""
    from training.distributed_config import DistributedSettings
    from training.launcher import launch_workers

    two = DistributedSettings(num_processes=2)
    (tmp_path / "empty").mkdir()
    stage = {"kind": "stage", "stage": "sft", "config": sft(2).to_dict(), "model_dir": str(tmp_path / "empty"),
             "data_dir": str(tmp_path), "output_dir": str(tmp_path / "out")}
    with pytest.raises(TrainingError, match="empty: no config.json, not a Hugging Face model directory"):
        launch_workers(stage, two, "cpu", tmp_path / "a", "sft")
    with pytest.raises(RuntimeError, match=r"probe: worker rank [01] of 2 failed: ValueError: unknown job kind 'nope'"):
        launch_workers({"kind": "nope"}, two, "cpu", tmp_path / "b", "probe")


def test_of_ranks_failing_together_the_one_that_caused_it_is_named(tmp_path):
    from training.launcher import _root_cause, error_file

    def record(rank: int, user_error: bool) -> None:
        error_file(tmp_path, rank).write_text(json.dumps({"type": "E", "message": "m", "user_error": user_error}))

    record(0, False)  # rank 0 lost its connection to rank 1, which was killed without a word
    assert _root_cause([0, 1], tmp_path) == 1
    record(1, False)
    assert _root_cause([0, 1], tmp_path) == 0
    record(1, True)  # a user error says most
    assert _root_cause([0, 1], tmp_path) == 1
