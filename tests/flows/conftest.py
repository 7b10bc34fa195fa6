"""A micro recipe: every stage of the real pipeline, sized to run in a couple of minutes on 2 cores."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

MICRO_RECIPE = {
    "name": "micro-e2e",
    "threads": 1,
    "base": {"source": "embedded", "embedded": {"preset": "micro"}},
    "data": {
        "sft_per_task": 48, "pref_train_per_task": 24, "pref_heldout_per_task": 6, "grpo_per_task": 16,
        "heldout_per_task": 8, "safety_train_per_category": 6, "safety_heldout_per_category": 4,
        "text_heldout": 16, "calibration": 16,
    },
    "evals": {"max_examples": 8, "max_new_tokens": 8, "batch_size": 16},
    "training": {
        "sft": {"max_steps": 3, "batch_size": 4, "save_steps": 2, "logging_steps": 1, "max_seq_len": 64,
                "lora": {"r": 4, "alpha": 8}},
        "dpo": {"max_steps": 2, "batch_size": 4, "save_steps": 2, "logging_steps": 1, "max_seq_len": 64,
                "lora": {"r": 4, "alpha": 8}},
        "grpo": {"max_steps": 2, "batch_size": 4, "num_generations": 2, "save_steps": 2, "logging_steps": 1,
                 "max_completion_length": 6, "max_seq_len": 64, "lora": {"r": 4, "alpha": 8}},
    },
    "quantize": {"methods": ["gptq"], "bits": 4, "group_size": 32, "calibration_samples": 8,
                 "calibration_seq_len": 32, "fidelity_samples": 4, "gate_gptq_beats_rtn": False},
    "bundle": {"max_shard_size": "100KB", "tp_degrees": [1, 2]},
    "gates": ["format_adherence >= 0.0", "perplexity <= 1000000"],
}


@pytest.fixture()
def micro_recipe(tmp_path: Path) -> Path:
    """Write the micro recipe (with its own workdir) into a temp dir and return its path."""
    recipe = dict(MICRO_RECIPE, workdir=str(tmp_path / "workdir"))
    path = tmp_path / "micro.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path
