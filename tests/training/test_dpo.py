"""DPO stage on the micro model: the reference is the input model, preferences move, output is a full HF dir."""

from __future__ import annotations

import json
import math

import pytest

from training.dpo import run_dpo
from training.stage_config import DPOStageConfig, LoraSettings, TrainingError


def tiny_dpo(**overrides) -> DPOStageConfig:
    # sft_weight 0: plain DPO (its loss starts at ln 2); the default adds the NLL term
    # pairs static: these tests are about DPO's own mechanics (test_on_policy_pairs.py samples the model)
    values = dict(pairs="static", max_steps=4, batch_size=4, learning_rate=5e-3, beta=0.1, sft_weight=0.0, save_steps=2,
                  logging_steps=1, lora=LoraSettings(r=4, alpha=8), heldout_curve_prompts=4)
    values.update(overrides)
    return DPOStageConfig(**values)


def test_dpo_starts_at_its_reference_and_writes_a_full_model(micro_base_dir, micro_data_dir, tmp_path):
    result = run_dpo(tiny_dpo(), micro_base_dir, micro_data_dir, tmp_path / "dpo")
    rows = [row for row in result.log_history if "loss" in row and "rewards/margins" in row]
    # Fresh LoRA adapters leave the policy equal to the reference (the input model): loss = ln 2, margin 0.
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)
    assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-4)
    assert any(abs(row["rewards/margins"]) > 0 for row in rows[1:])
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json"):
        assert (result.output_dir / name).is_file()
    saved = json.loads((result.output_dir / "stage_result.json").read_text())
    assert saved["stage"] == "dpo" and saved["adapter_dir"].endswith("adapter")


def test_sft_weight_adds_an_nll_term_on_the_chosen_reply(micro_base_dir, micro_data_dir, tmp_path):
    result = run_dpo(tiny_dpo(max_steps=1, sft_weight=1.0), micro_base_dir, micro_data_dir, tmp_path / "dpo")
    first = next(row for row in result.log_history if "loss" in row)
    assert first["loss"] > math.log(2) + 0.05  # ln 2 from the preference term plus the chosen reply's NLL


def test_preference_data_without_rejected_is_one_clear_error(micro_base_dir, tmp_path):
    record = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "x"}]}
    (tmp_path / "pref_train.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(TrainingError, match=r"pref_train.jsonl:1: missing column\(s\) \['rejected'\]"):
        run_dpo(tiny_dpo(), micro_base_dir, tmp_path, tmp_path / "dpo")


def test_dpo_config_rejects_bad_values():
    with pytest.raises(ValueError, match="beta"):
        DPOStageConfig(beta=0)
    with pytest.raises(ValueError, match="sft_weight"):
        DPOStageConfig(sft_weight=-1.0)
