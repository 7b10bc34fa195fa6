"""Fixtures for the serving tests: a random-init tiny Llama with a locally trained byte-level tokenizer.

Built in a second from nothing (no hub). Byte-level BPE makes multi-byte UTF-8 characters span several
tokens, which the detokenizer tests need. Weights use a wide init so greedy argmax has clear margins.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Answer: 42. Question: what is 2 + 2?",
    "Grüße aus München — ça va? naïve café résumé",
    "日本語のテキストと中文文本 混合 🙂🚀 emoji",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a tiny model that served many requests.",
] * 20


def build_tiny_model(out: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     seed: int = 0, max_pos: int = 512, specials: tuple[str, ...] = ()) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS + list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=SPECIALS[3:] + list(specials))
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    end_id = fast.convert_tokens_to_ids("<|end|>")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_pos, initializer_range=0.3, bos_token_id=fast.bos_token_id,
                      eos_token_id=[end_id, fast.eos_token_id], pad_token_id=fast.pad_token_id,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=fast.bos_token_id, eos_token_id=[end_id, fast.eos_token_id],
                     pad_token_id=fast.pad_token_id).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory) -> Path:
    """A second tiny Llama with other weights (and the same tokenizer): a candidate that answers differently."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-b"), seed=1)


@pytest.fixture(scope="module")
def replicas_on_one_core() -> Iterator[int | None]:
    """For a module whose rollouts are judged on latency against a baseline replica (an A/A pair): this worker,
    and every replica, gateway and load generator it starts, runs on one core for the module.

    Why: the other xdist worker's module runs beside it on the 2-core host. Three busy processes on two cores
    leave one core's pair sharing it while the third has a core to itself, and the scheduler keeps it so for the
    seconds a canary step lasts: an A/A canary then read ITL ×1.74 against its baseline (p = 2e-5) and was rolled
    back (`make test` at dd4d709). On one core both replicas of the pair meet the same neighbours, so the pair stays
    A/A. Each worker takes its own core (gw0 the first), so two such modules never crowd one core. None (and
    nothing pinned) where the host has a single core or no affinity call."""
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    if len(cores) < 2:
        yield None
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    core = cores[int(worker[2:]) % len(cores) if worker[2:].isdigit() else 0]
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, before)
