"""Plain Llama-family checkpoints read without transformers' modeling code (serving/engine/llama_checkpoint.py):
the same tensors, rotary frequencies and norms as transformers loads, the same tokens and logprobs served as
through the HF model, for the shapes the loader takes (untied and tied heads, Qwen2's q/k/v biases, Mistral,
Llama 3's rope scaling, sharded weights); everything else is left to transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from serving.engine import EngineConfig, LLMEngine, SamplingParams
from serving.engine.llama_checkpoint import load_plain, plain_reason

CPU = torch.device("cpu")


def _save(out: Path, kind: str, **extra) -> Path:
    """A tiny random checkpoint of ``kind`` saved by transformers itself (safetensors)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}
    config_class, model_class = classes[kind]
    shard = extra.pop("max_shard_size", None)
    torch.manual_seed(0)
    config = config_class(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          initializer_range=0.2, **extra)
    model = model_class(config)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    return out


VARIANTS = {
    "llama": dict(kind="llama", tie_word_embeddings=False),
    "llama-tied": dict(kind="llama", tie_word_embeddings=True),
    "llama-attention-bias": dict(kind="llama", attention_bias=True),
    "llama3-rope": dict(kind="llama", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 32}),
    "qwen2": dict(kind="qwen2", tie_word_embeddings=False),
    "mistral": dict(kind="mistral", sliding_window=None),
    "sharded": dict(kind="llama", max_shard_size="100KB"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_plain_load_holds_what_transformers_loads(tmp_path, variant):
    from transformers import AutoModelForCausalLM

    path = _save(tmp_path / variant, **VARIANTS[variant])
    assert plain_reason(path) is None
    plain = load_plain(path, torch.float32, CPU)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    want, got = hf.state_dict(), plain.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert (plain.lm_head.weight is plain.model.embed_tokens.weight) == \
        (hf.lm_head.weight is hf.model.embed_tokens.weight)
    assert torch.equal(plain.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    assert plain.model.rotary_emb.attention_scaling == hf.model.rotary_emb.attention_scaling
    assert plain.model.norm.variance_epsilon == hf.model.norm.variance_epsilon
    for field in ("num_key_value_heads", "max_position_embeddings", "num_hidden_layers", "vocab_size"):
        assert getattr(plain.config, field) == getattr(hf.config, field), field


@pytest.mark.parametrize("variant", ["llama", "llama-tied", "qwen2", "llama3-rope"])
def test_served_tokens_and_logprobs_equal_the_hf_models(tmp_path, variant):
    path = _save(tmp_path / variant, **VARIANTS[variant])
    prompts = [[5, 9, 17, 3], [40, 2, 2, 77, 101, 6, 8]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    outputs = {}
    for impl in ("auto", "hf"):
        engine = LLMEngine.from_pretrained(path, EngineConfig(num_blocks=64, model_impl=impl))
        assert (type(engine.runner.model).__name__ == "Module") == (impl == "auto")  # which loader ran
        outputs[impl] = engine.generate(prompts, params)
    for ours, theirs in ((a.outputs[0], b.outputs[0]) for a, b in zip(outputs["auto"], outputs["hf"])):
        assert ours.token_ids == theirs.token_ids
        assert len(ours.logprobs) == len(theirs.logprobs) == len(ours.token_ids)
        for token, a, b in zip(ours.token_ids, ours.logprobs, theirs.logprobs):
            assert a[token] == pytest.approx(b[token], abs=1e-4)


@pytest.mark.parametrize("change, why", [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantized"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, "rope type 'yarn'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),  # transformers 4's spelling
    ({"model_type": "gemma"}, "model_type 'gemma'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"sliding_window": 64, "use_sliding_window": True}, "sliding window"),
])
def test_anything_else_is_left_to_transformers(tmp_path, change, why):
    path = _save(tmp_path / "m", kind="llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    assert plain_reason(path) == why
    assert load_plain(path, torch.float32, CPU) is None


def test_a_tied_head_the_config_does_not_declare_is_left_to_transformers(tmp_path):
    """transformers would give such a head random weights and warn; reading it as tied would hide that."""
    path = _save(tmp_path / "m", kind="llama", tie_word_embeddings=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    assert load_plain(path, torch.float32, CPU) is None


def test_the_tokenizer_is_the_class_autotokenizer_picks_on_its_own(tiny_model_dir):
    from transformers import AutoTokenizer

    engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=16))
    assert type(engine.runner.model).__name__ == "Module"  # the plain load, so the tokenizer got its config
    alone = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert type(engine.tokenizer) is type(alone)
    text = "Hello <|end|> world 123"
    assert engine.tokenizer(text)["input_ids"] == alone(text)["input_ids"]


def test_llama3_rope_written_the_transformers_4_way_reads_the_same(tmp_path):
    from transformers import AutoModelForCausalLM

    path = _save(tmp_path / "m", **VARIANTS["llama3-rope"])
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    (path / "config.json").write_text(json.dumps(config))
    plain = load_plain(path, torch.float32, CPU)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert torch.equal(plain.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
