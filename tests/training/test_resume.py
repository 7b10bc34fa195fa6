"""Kill-and-resume: a stage process SIGKILLed after a checkpoint continues from that checkpoint when re-run."""

from __future__ import annotations

import textwrap

import pytest
from stage_kill import kill_at_first_checkpoint  # tests/training/stage_kill.py

from training.checkpoints import FINISHED_MARKER
from training.sft import run_sft
from training.stage_config import LoraSettings, SFTStageConfig

MAX_STEPS, SAVE_STEPS = 12, 3

CHILD = textwrap.dedent("""
    import sys, time
    import torch
    torch.set_num_threads(1)
    import transformers

    # Injected slowness (this child only): each step takes >= 0.3 s, so the parent can kill it mid-run.
    _step = transformers.Trainer.training_step
    def slow_step(self, *args, **kwargs):
        time.sleep(0.3)
        return _step(self, *args, **kwargs)
    transformers.Trainer.training_step = slow_step

    sys.path.insert(0, sys.argv[4])
    from test_resume import config
    from training.sft import run_sft
    run_sft(config(), sys.argv[1], sys.argv[2], sys.argv[3])
""")


def config() -> SFTStageConfig:
    return SFTStageConfig(max_steps=MAX_STEPS, save_steps=SAVE_STEPS, logging_steps=1, batch_size=4,
                          learning_rate=5e-3, lora=LoraSettings(r=4, alpha=8), seed=3)


@pytest.mark.slow
def test_sigkilled_stage_resumes_from_its_last_checkpoint(micro_base_dir, micro_data_dir, tmp_path):
    out = tmp_path / "sft"
    killed_at = kill_at_first_checkpoint(CHILD, [str(micro_base_dir), str(micro_data_dir), str(out)], out, tmp_path)
    assert SAVE_STEPS <= killed_at < MAX_STEPS
    assert not (out / FINISHED_MARKER).exists()

    result = run_sft(config(), micro_base_dir, micro_data_dir, out)
    assert result.resumed_from_step == killed_at
    logged_steps = [row["step"] for row in result.log_history if "loss" in row]
    assert logged_steps[-1] == MAX_STEPS and logged_steps == sorted(set(logged_steps))  # no step trained twice
    # Steps up to the checkpoint come from its saved state; the re-run itself trained only the rest.
    assert result.metrics["train_wall_seconds"] > 0 and (out / FINISHED_MARKER).is_file()
    assert not result.skipped and not (out / "checkpoints").exists()
