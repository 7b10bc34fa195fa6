"""merge_adapter folds LoRA into full-precision weights: same outputs as the adapter model, a complete HF dir."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.hardware import detect_hardware
from training.lora import attach_adapters, load_base_model
from training.merge import merge_adapter
from training.stage_config import LoraSettings, TrainingError


def _random_adapter(base_dir, out_dir):
    """An adapter with non-zero B (init_lora_weights=False), so merging visibly changes the weights."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False,
                        task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    model.save_pretrained(str(out_dir))
    return model.eval()


def test_merged_model_matches_the_adapter_model(micro_base_dir, tmp_path):
    peft_model = _random_adapter(micro_base_dir, tmp_path / "adapter")
    out = merge_adapter(tmp_path / "adapter", micro_base_dir, tmp_path / "merged")

    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(
        (micro_base_dir / "generation_config.json").read_text())
    assert AutoTokenizer.from_pretrained(str(out)).chat_template
    assert not any("lora" in k for k in load_file(str(out / "model.safetensors")))

    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(str(micro_base_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[0, 5, 9, 12, 20, 7]])
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        before = base(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (got - before).abs().max() > 1e-3  # the adapter really changed something


def test_qlora_adapter_merges_onto_unquantized_base_weights(micro_base_dir, tmp_path):
    settings = LoraSettings(r=4, alpha=8, target_modules=["q_proj"], qlora=True)
    model = attach_adapters(load_base_model(micro_base_dir, settings, detect_hardware()), settings)
    with torch.no_grad():  # give B non-zero values, as training would
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.01)
    model.save_pretrained(str(tmp_path / "adapter"))
    out = merge_adapter(tmp_path / "adapter", micro_base_dir, tmp_path / "merged")

    base = load_file(str(micro_base_dir / "model.safetensors"))
    merged = load_file(str(out / "model.safetensors"))
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    a = next(v for k, v in adapter.items() if "layers.0.self_attn.q_proj.lora_A" in k)
    b = next(v for k, v in adapter.items() if "layers.0.self_attn.q_proj.lora_B" in k)
    assert merged[key].dtype == torch.float32
    torch.testing.assert_close(merged[key], base[key] + (8 / 4) * (b @ a), atol=1e-6, rtol=1e-5)


def test_merge_refuses_a_directory_without_adapter(micro_base_dir, tmp_path):
    with pytest.raises(TrainingError, match="adapter_config.json"):
        merge_adapter(tmp_path, micro_base_dir, tmp_path / "merged")
