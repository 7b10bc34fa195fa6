"""configs/local-model.example.yaml's stages on a local Llama with 2 KV heads, planned for TP 1, 2 and 4.

This is the new user's path from the issue: a local checkpoint with 2 KV heads went through base, SFT, DPO,
GRPO and GPTQ, then the bundle stage refused TP 4. Here a tiny model of that shape (4 heads, 2 KV heads of
32 dims: AWQ's 64-wide outputs fit) runs the example recipe, counts and steps shrunk to seconds, through the
real CLI; every bundle must plan TP 4 by replicating each KV head on 2 ranks and verify at `--tp 4`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from artifacts.errors import ConfigError
from flows.preflight import preflight
from flows.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "configs" / "local-model.example.yaml"
LIFECYCLE = [sys.executable, "-m", "flows.cli"]


def _local_model(tmp_path: Path) -> Path:
    """A local HF dir: the embedded recipe's tokenizer and chat template, a Llama with 2 KV heads, one step of
    training (weights near their random init). 256 positions of context."""
    from training.base_model import BaseModelConfig, build_base_model

    config = BaseModelConfig(preset="micro", hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2,
                             steps=1, warmup_steps=0, chats_per_task=50, facts_per_task=20, plain_sentences=20)
    return build_base_model(config, tmp_path / "models")


def _shrunk_example(tmp_path: Path, model: Path) -> Path:
    """The example with its base pointed at `model` and every count and step cut to seconds; its LoRA settings
    (QLoRA, default targets: all seven projections), methods, bits and TP degrees [1, 2, 4] kept."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(name="local-example-e2e", workdir=str(tmp_path / "workdir"), threads=1)
    data["base"]["source"] = str(model)
    data["data"].update(sft_per_task=8, pref_train_per_task=4, pref_heldout_per_task=2, grpo_per_task=4,
                        heldout_per_task=2, safety_train_per_category=1, safety_heldout_per_category=1,
                        text_heldout=4, calibration=8)
    data["evals"].update(max_examples=2, max_new_tokens=4, batch_size=8)
    for name in ("sft", "dpo", "grpo"):
        stage = data["training"][name]
        stage.update(max_steps=1, batch_size=2, grad_accum=1, logging_steps=1, save_steps=1)
        if name != "grpo":
            stage["max_seq_len"] = 128  # the example's 512 exceeds this model's 256 positions
    data["training"]["grpo"].update(num_generations=2, max_completion_length=4)
    # group 32: the example's 64 would leave o_proj's 128 in-features 2 groups, which 4 ranks cannot share
    data["quantize"].update(group_size=32, calibration_samples=4, calibration_seq_len=32, fidelity_samples=2)
    data["bundle"].update(max_shard_size="200KB", tp_degrees=[1, 2, 4])
    data["rollout"] = {"mode": "off"}  # a fleet of engine processes is not the example's point; smoke.yaml has it
    path = tmp_path / "local-example.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.slow
@pytest.mark.usefixtures("on_prefect_server")
def test_example_recipe_on_a_two_kv_head_model_bundles_and_verifies_at_tp_4(tmp_path: Path) -> None:
    model = _local_model(tmp_path)
    assert json.loads((model / "config.json").read_text())["num_key_value_heads"] == 2

    # The example as it is, pointed at this model: refused in milliseconds, naming the key.
    as_is = yaml.safe_load(EXAMPLE.read_text())
    as_is["base"]["source"] = str(model)
    (tmp_path / "as-is.yaml").write_text(yaml.safe_dump(as_is))
    with pytest.raises(ConfigError, match=r"as-is\.yaml: training\.sft\.max_seq_len: 512 exceeds the model's "
                                          r"context \(max_position_embeddings 256\)"):
        preflight(load_recipe(tmp_path / "as-is.yaml"), tmp_path / "as-is.yaml")

    recipe = _shrunk_example(tmp_path, model)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    result = subprocess.run([*LIFECYCLE, "run", str(recipe), "--json-out", str(tmp_path / "summary.json")],
                            capture_output=True, text=True, timeout=1800, cwd=REPO, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    stages = json.loads((tmp_path / "summary.json").read_text())["stages"]
    for name in ("sft", "dpo", "grpo", "quantize"):
        assert not stages[name].get("cached"), name

    from artifacts.manifest import read_manifest

    for variant in ("fp", "gptq", "awq"):
        bundle = Path(stages[f"bundle-{variant}"]["path"])
        plans = read_manifest(bundle).shard_plan.tp
        assert sorted(plans, key=int) == ["1", "2", "4"]
        assert plans["4"].kv_heads == [[0], [0], [1], [1]], variant
        verify = subprocess.run([*LIFECYCLE, "bundle", "verify", str(bundle), "--tp", "4"], capture_output=True,
                                text=True, timeout=300, cwd=REPO, env=env)
        assert verify.returncode == 0, verify.stderr
        assert "tp degrees 1,2,4" in verify.stdout
