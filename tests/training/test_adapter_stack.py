"""Stacking the stages' adapters (issue 33, item 4's groundwork): SFT's adapter, merged, then DPO's trained on
the merge, equal one adapter of rank r₁ + r₂ on the first base, served by PEFT and by our engine alike.

Real PEFT adapters with random B (PEFT starts B at zero); the second targets other projections at another rank
with rsLoRA, so zero blocks, two scalings and unequal ranks are all exercised.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.lora_support import make_adapter
from training.adapter_stack import stack_adapters
from training.merge import merge_adapter
from training.stage_config import TrainingError


def _logits(model_dir: Path, adapter: Path | None, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model(ids).logits


def test_stacked_adapters_on_the_base_equal_the_merged_chain(micro_base_dir, tmp_path):
    base = Path(micro_base_dir)
    sft = make_adapter(base, tmp_path / "sft-adapter", rank=4, targets=["q_proj", "v_proj", "down_proj"], seed=1,
                       alpha=12, scale=0.2)
    merged_sft = merge_adapter(sft, base, tmp_path / "sft")
    dpo = make_adapter(merged_sft, tmp_path / "dpo-adapter", rank=2, targets=["q_proj", "o_proj", "up_proj"], seed=2,
                       rslora=True, alpha=6, scale=0.2)
    merged_dpo = merge_adapter(dpo, merged_sft, tmp_path / "dpo")
    stacked = stack_adapters([sft, dpo], tmp_path / "stacked")
    config = json.loads((stacked / "adapter_config.json").read_text())
    assert config["r"] == 6 and json.loads((stacked / "stacked_from.json").read_text())["ranks"] == [4, 2]
    assert "stacked_ranks" not in config  # PEFT's LoraConfig would warn on it
    assert config["target_modules"] == ["down_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    ids = torch.tensor([[1, 5, 9, 12, 7, 3, 22, 8]])
    want = _logits(merged_dpo, None, ids)
    got = _logits(base, stacked, ids)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert not torch.allclose(_logits(base, None, ids), want, atol=1e-2)  # the adapters do change the model
    # our engine serving the stacked adapter on the base answers as it serves the merged model
    from serving.engine import EngineConfig, LLMEngine, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 5, 9, 12, 7], [1, 30, 31, 32, 33, 34, 35]]
    on_base = LLMEngine.from_pretrained(base, EngineConfig(max_loras=1, max_lora_rank=8, kv_memory_bytes=4 << 20))
    on_base.load_lora("stacked", stacked)
    served = [o.outputs[0].token_ids for o in on_base.generate(prompts, greedy, loras=["stacked"] * 2)]
    merged = LLMEngine.from_pretrained(merged_dpo, EngineConfig(kv_memory_bytes=4 << 20))
    assert served == [o.outputs[0].token_ids for o in merged.generate(prompts, greedy)]


def test_adapters_of_other_shapes_cannot_be_stacked(tmp_path):
    with pytest.raises(TrainingError, match="adapter_config.json: missing"):
        stack_adapters([tmp_path], tmp_path / "out")
    with pytest.raises(TrainingError, match="no adapters"):
        stack_adapters([], tmp_path / "out")
