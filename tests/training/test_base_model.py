"""The embedded base model: micro preset builds, loads with HF Auto classes, generates, caches."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.base_model import (
    PRETRAIN_LOG,
    BaseModelConfig,
    BaseModelError,
    build_base_model,
    ensure_base_model,
    validate_model_dir,
)
from training.tokenizer import END, EOS, render_chat


def test_micro_dir_is_a_standard_hf_model(micro_base_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", PRETRAIN_LOG):
        assert (micro_base_dir / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(micro_base_dir)
    model = AutoModelForCausalLM.from_pretrained(micro_base_dir)
    config = json.loads((micro_base_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert model.config.vocab_size >= len(tokenizer)

    generation = json.loads((micro_base_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.convert_tokens_to_ids(END),
                                          tokenizer.convert_tokens_to_ids(EOS)]
    tok_cfg = json.loads((micro_base_dir / "tokenizer_config.json").read_text())
    messages = [{"role": "user", "content": "What is 12 + 34?"}]
    assert "chat_template" in tok_cfg
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        render_chat(messages, add_generation_prompt=True)

    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


def test_pretraining_lowers_the_loss(micro_base_dir: Path) -> None:
    log = json.loads((micro_base_dir / PRETRAIN_LOG).read_text())
    assert len(log["loss"]) == len(log["step"]) > 1
    assert log["loss"][-1] < log["loss"][0] * 0.7
    assert log["tokens_per_second"] > 0


def test_same_recipe_hits_the_cache(micro_base_dir: Path, base_model_cache: Path) -> None:
    before = (micro_base_dir / "model.safetensors").stat().st_mtime_ns
    build = ensure_base_model(BaseModelConfig(preset="micro", threads=1), base_model_cache)
    assert build.cached and build.path == micro_base_dir
    assert build.seconds < 1.0
    assert (micro_base_dir / "model.safetensors").stat().st_mtime_ns == before
    assert not [p for p in base_model_cache.iterdir() if p.name.startswith(".tmp")]


def test_recipe_digest_tracks_weights_not_speed_knobs() -> None:
    micro = BaseModelConfig(preset="micro")
    assert micro.digest() == BaseModelConfig(preset="micro", threads=2, device="cpu").digest()
    assert micro.digest() != BaseModelConfig(preset="micro", steps=101).digest()
    assert micro.digest() != BaseModelConfig(preset="default").digest()


@pytest.mark.parametrize("kwargs, field", [
    ({"preset": "huge"}, "preset"), ({"preset": "micro", "num_heads": 3}, "num_heads"),
    ({"preset": "micro", "num_kv_heads": 3}, "num_kv_heads"),
    ({"preset": "micro", "seq_len": 512}, "seq_len"),
    ({"preset": "micro", "lr": -1.0}, "lr"),
])
def test_bad_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        BaseModelConfig(**kwargs)


def test_validate_accepts_a_local_hf_dir(micro_base_dir: Path) -> None:
    assert validate_model_dir(micro_base_dir) == micro_base_dir


def test_building_the_micro_preset_again_uses_the_cache(micro_base_dir: Path, base_model_cache: Path) -> None:
    assert build_base_model(BaseModelConfig(preset="micro"), base_model_cache) == micro_base_dir


def test_validate_errors_name_path_and_what_is_missing(tmp_path: Path, micro_base_dir: Path) -> None:
    with pytest.raises(BaseModelError, match="no such directory"):
        validate_model_dir(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BaseModelError, match=f"{empty}.*config.json"):
        validate_model_dir(empty)

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_bytes((micro_base_dir / "config.json").read_bytes())
    with pytest.raises(BaseModelError, match="missing weights"):
        validate_model_dir(partial)
    os.link(micro_base_dir / "model.safetensors", partial / "model.safetensors")
    with pytest.raises(BaseModelError, match="missing tokenizer"):
        validate_model_dir(partial)

    (partial / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(BaseModelError, match="not a causal LM"):
        validate_model_dir(partial)


def test_greedy_accuracy_scores_greedy_replies(micro_base_dir: Path) -> None:
    from training.greedy_accuracy import greedy_accuracy

    result = greedy_accuracy(micro_base_dir, "addition", n=8, batch_size=8, max_new_tokens=6)
    assert result.n == 8 and 0.0 <= result.accuracy <= 1.0 and 0.0 <= result.format_rate <= 1.0
    assert result.samples and all(s["prompt"].startswith("What is ") for s in result.samples)


def test_tokenizer_config_is_portable(micro_base_dir: Path) -> None:
    cfg = json.loads((micro_base_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["additional_special_tokens"] == ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tokenizer = AutoTokenizer.from_pretrained(micro_base_dir)
    assert "<|end|>" in tokenizer.all_special_tokens


def test_corpus_holds_chat_text_but_no_heldout_problem() -> None:
    from training.corpus import build_corpus
    from training.tasks import generate_examples, safety_pool

    spec = BaseModelConfig(preset="micro").corpus_spec()
    docs = build_corpus(spec)
    assert docs == build_corpus(spec)
    text = "\n".join(docs)
    assert "<|assistant|>\nAnswer: " in text and "<|system|>\n" in text and "I can't help with that." in text
    heldout = [ex.prompt for ex in generate_examples("addition", "heldout", 1400)]
    heldout += [ex.prompt for exs in safety_pool("heldout").values() for ex in exs]
    assert not [p for p in heldout if f"\n{p}<|end|>" in text]
