"""The preflight refuses every recipe value the model cannot take, naming the recipe key, before any training.

The model's shape comes from the embedded preset (nothing built) or a local directory's config.json (no weights
read: the weight files here are empty). Each refusal is one line `<recipe file>: <key>: <reason>`.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from artifacts.errors import ConfigError
from flows.preflight import check_model_fit, preflight
from flows.recipe import load_recipe

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EXAMPLE = CONFIGS / "local-model.example.yaml"

# The published config.json architecture fields of the two checkpoints configs/local-model.example.yaml names.
QWEN25_05B = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896,
              "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "max_position_embeddings": 32768, "vocab_size": 151936,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
LLAMA32_1B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
              "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072, "vocab_size": 128256,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16"}

# The embedded micro preset: hidden 64, 4 heads of 16 dims, 2 KV heads, intermediate 192, context 256.
MICRO: dict[str, Any] = {"name": "x", "base": {"source": "embedded", "embedded": {"preset": "micro"}},
                         "quantize": {"methods": ["gptq"], "group_size": 16}, "bundle": {"tp_degrees": [1, 2, 4]}}
CONTEXT = "the model's context (max_position_embeddings 256)"


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _write(tmp_path: Path, data: dict[str, Any], name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"workdir": str(tmp_path / "workdir"), **data}, sort_keys=False))
    return path


def _refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        preflight(load_recipe(path), path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message.removeprefix(f"{path}: ")


def test_micro_with_two_kv_heads_takes_tp_4_without_building_anything(tmp_path):
    path = _write(tmp_path, MICRO)
    preflight(load_recipe(path), path)  # 2 KV heads over 4 ranks: replicated, as vLLM serves them
    assert not (tmp_path / "workdir").exists()


@pytest.mark.parametrize(("override", "expected"), [
    ({"bundle": {"tp_degrees": [1, 3]}},
     "bundle.tp_degrees: tp degree 3: num_attention_heads = 4 is not divisible by 3"),
    ({"base": {"embedded": {"hidden_size": 96, "num_heads": 6}}, "quantize": None, "bundle": {"tp_degrees": [3]}},
     "bundle.tp_degrees: tp degree 3: exceeds num_key_value_heads = 2 but is not a multiple of it"),
    ({"quantize": {"group_size": 32}},  # o_proj's 64 in-features make 2 groups: 4 ranks cannot share them
     "bundle.tp_degrees: tp degree 4: tensor model.layers.0.self_attn.o_proj.qzeros shape [2, 8] dim 0 = 2 is not "
     "divisible by 4 (in the gptq bundle: 4-bit, group_size 32)"),
    ({"training": {"sft": {"lora": {"target_modules": ["q_proj", "c_attn"]}}}},
     "training.sft.lora.target_modules: ['c_attn'] not found in the model; its linear layers are "
     "['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']"),
    ({"training": {"grpo": {"lora": {"target_modules": ["query_key_value"]}}}},
     "training.grpo.lora.target_modules: ['query_key_value'] not found in the model"),
    ({"training": {"dpo": {"max_seq_len": 512}}}, f"training.dpo.max_seq_len: 512 exceeds {CONTEXT}"),
    ({"training": {"grpo": {"max_completion_length": 256}}},
     f"training.grpo.max_completion_length: 256 leaves no room for a prompt in {CONTEXT}: prompt + completion "
     "must fit"),
    ({"evals": {"max_new_tokens": 300}}, f"evals.max_new_tokens: 300 leaves no room for a prompt in {CONTEXT}"),
    ({"quantize": {"calibration_seq_len": 512}}, f"quantize.calibration_seq_len: 512 exceeds {CONTEXT}"),
    ({"quantize": {"group_size": 128}}, "quantize.group_size: group_size 128 does not divide the in-features of"),
    ({"quantize": {"methods": ["gptq", "awq"]}},
     "quantize.methods: AWQ (gptqmodel's clip search) needs out-features that are multiples of 64"),
    ({"quantize": {"bits": 3}}, "quantize.bits: 3-bit checkpoints cannot be bundled"),
    ({"bundle": {"max_context": 512}}, f"bundle.max_context: 512 exceeds {CONTEXT}"),
])
def test_a_value_the_model_cannot_take_is_named_by_its_key(tmp_path, override, expected):
    message = _refusal(_write(tmp_path, _merge(MICRO, override)))
    assert message.startswith(expected), message
    assert not (tmp_path / "workdir").exists()


def test_a_disabled_stage_is_not_checked(tmp_path):
    path = _write(tmp_path, _merge(MICRO, {"training": {"sft": {"enabled": False, "max_seq_len": 4096,
                                                                "lora": {"target_modules": ["c_attn"]}}}}))
    preflight(load_recipe(path), path)


def _local_model(directory: Path, config: dict[str, Any]) -> Path:
    """A model dir as validate_model_dir sees it, with empty weight and tokenizer files: nothing is loaded."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"")
    (directory / "tokenizer.json").write_text("{}")
    return directory


def _example(tmp_path: Path, source: Path) -> Path:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["base"]["source"] = str(source)
    return _write(tmp_path, data, name="my-model.yaml")


@pytest.mark.parametrize("config", [QWEN25_05B, LLAMA32_1B], ids=["qwen2.5-0.5b", "llama-3.2-1b"])
def test_the_example_recipe_fits_the_checkpoints_it_names(tmp_path, config):
    path = _example(tmp_path, _local_model(tmp_path / "model", config))
    preflight(load_recipe(path), path)


def test_the_old_example_is_refused_for_qwen_before_training(tmp_path):
    """The example used to plan TP 1, 2, 4 with group size 128: Qwen2.5-0.5B's 14 heads cannot take 4, and at TP 2
    its o_proj's 7 groups of 128 cannot be shared by 2 ranks. Both used to surface only at the bundle stage."""
    path = _example(tmp_path, _local_model(tmp_path / "model", QWEN25_05B))
    data = yaml.safe_load(path.read_text())
    data["quantize"]["group_size"] = 128
    path.write_text(yaml.safe_dump(data))
    assert _refusal(path) == ("bundle.tp_degrees: tp degree 2: tensor model.layers.0.self_attn.o_proj.qzeros shape "
                              "[7, 112] dim 0 = 7 is not divisible by 2 (in the gptq bundle: 4-bit, group_size 128)")
    data["quantize"]["group_size"] = 64
    data["bundle"]["tp_degrees"] = [1, 2, 4]
    path.write_text(yaml.safe_dump(data))
    assert _refusal(path) == "bundle.tp_degrees: tp degree 4: num_attention_heads = 14 is not divisible by 4"


def test_a_local_model_of_an_unsupported_family_is_refused(tmp_path):
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 128, "vocab_size": 300}
    path = _write(tmp_path, {"name": "x", "base": {"source": str(_local_model(tmp_path / "gpt2", gpt2))}})
    assert _refusal(path).startswith("base.source: config.json: model_type 'gpt2' is not a supported Llama-family "
                                     "type")


@pytest.mark.parametrize("name", ["default.yaml", "smoke.yaml", "smoke-distributed.yaml", "drill-broken-refusals.yaml"])
def test_shipped_recipes_pass(name):
    preflight(load_recipe(CONFIGS / name), CONFIGS / name)


def test_check_model_fit_reads_config_fields_only():
    """The same check on a bare config.json mapping (what a caller holding only the config can use)."""
    recipe = load_recipe(CONFIGS / "smoke.yaml")
    check_model_fit(recipe, LLAMA32_1B, "smoke.yaml")
    check_model_fit(recipe, {**LLAMA32_1B, "num_key_value_heads": 1}, "smoke.yaml")  # MQA: replicated on both
    with pytest.raises(ConfigError, match=re.escape("smoke.yaml: bundle.tp_degrees: tp degree 2: "
                                                    "num_key_value_heads = 3 is not divisible by 2")):
        check_model_fit(recipe, {**LLAMA32_1B, "num_attention_heads": 24, "num_key_value_heads": 3}, "smoke.yaml")


def test_lifecycle_run_refuses_in_one_line_before_any_work(tmp_path):
    path = _write(tmp_path, _merge(MICRO, {"bundle": {"tp_degrees": [1, 3]}}))
    result = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(path)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path,
                            env={"LIFECYCLE_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: "), lines  # names the recipe file
    assert lines[0].endswith(": bundle.tp_degrees: tp degree 3: num_attention_heads = 4 is not divisible by 3")
    assert not (tmp_path / "home").exists() and not (tmp_path / "workdir").exists()
