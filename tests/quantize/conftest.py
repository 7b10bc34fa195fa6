"""Fixtures for the quantize tests: a tiny Llama and a tiny data dir.

The model is random-init (hidden 128, 2 layers, GQA 4/2) with a character-level tokenizer that
carries the contract's special tokens; its in-features divide by group size 32 and its
out-features suit AWQ. Built once per session in a few hundred milliseconds.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

GROUP_SIZE = 32
SPECIALS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<unk>"]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for code in [10, *range(32, 127)]:
        vocab[chr(code)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=SPECIALS[3:7],
    )
    fast.chat_template = (
        "<s>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    fast.save_pretrained(out)


def _sentences(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append(f"<|user|>\nWhat is {a}+{b}?<|end|>\n<|assistant|>\nAnswer: {a + b}<|end|>\n")
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    _write_tokenizer(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(SPECIALS) + 96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    # Larger-than-default init so outputs are far from uniform and quantization error shows in KL.
    cfg.initializer_range = 0.2
    LlamaForCausalLM(cfg).save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=[6, 2], pad_token_id=0).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-data")
    rng = random.Random(0)
    for name, n in (("calibration.jsonl", 64), ("text_heldout.jsonl", 16)):
        with open(out / name, "w") as handle:
            handle.writelines(json.dumps({"text": text}) + "\n" for text in _sentences(rng, n))
    return out


@pytest.fixture(scope="session")
def _mlflow_db(tmp_path_factory) -> str:
    """One sqlite tracking store per session: creating its tables costs ~10-20 s, so pay it once."""
    import mlflow

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    mlflow.MlflowClient(tracking_uri=uri).search_experiments()
    return uri


@pytest.fixture
def mlflow_tracking(_mlflow_db):
    """Point MLflow at the session's store for one test, then restore the previous URI."""
    import mlflow

    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(_mlflow_db)
    try:
        yield mlflow.MlflowClient()
    finally:
        mlflow.set_tracking_uri(previous)
