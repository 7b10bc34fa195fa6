"""Fixtures for the bundle tests: a tiny Llama model dir, a written bundle, and a real MLflow store.

The model comes from the shared `micro_base_dir` fixture when tests/conftest.py provides it; until then
(and as a fallback) a random-init 2-layer Llama with a freshly trained byte-level BPE tokenizer is built.
Random weights are enough here: bundles are about bytes, shapes and contracts, not model quality.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from artifacts.manifest import Lineage
from artifacts.writer import BundleConfig, write_bundle
from training.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS

CORPUS = [f"question {i}: what is {i} + {i * 3}? Answer: {i * 4}. The quick brown fox jumps." for i in range(200)]


def build_tokenizer(out_dir: Path, vocab_size: int = 300, corpus: list[str] | None = None):
    """Train a tiny byte-level BPE with the project's special tokens and chat template; save to out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus or CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", additional_special_tokens=list(SPECIAL_TOKENS[3:]),
                                        model_max_length=256)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_tiny_llama(out_dir: Path, tie_word_embeddings: bool = False, hidden_size: int = 64,
                     intermediate_size: int = 128) -> Path:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    end_ids = [tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.eos_token_id]
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=end_ids, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=end_ids,
                                               pad_token_id=tokenizer.pad_token_id, max_new_tokens=32)
    model.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(request, tmp_path_factory) -> Path:
    """The shared micro base model when available, else a random-init tiny Llama."""
    try:
        return Path(request.getfixturevalue("micro_base_dir"))
    except pytest.FixtureLookupError:
        return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def untied_model_dir(tmp_path_factory) -> Path:
    """A random-init tiny Llama with its own lm_head (the micro preset ties it to the embedding)."""
    return build_tiny_llama(tmp_path_factory.mktemp("untied_llama"), tie_word_embeddings=False)


@pytest.fixture(scope="session")
def small_shard_size(model_dir) -> str:
    """A shard limit that splits the model into about four shards, whatever its size."""
    from artifacts.safetensors_io import read_header, source_weight_files

    files = set(source_weight_files(model_dir).values())
    total = sum(t.end - t.begin for f in files for t in read_header(f).values())
    return f"{max(total // 4, 1)}B"


@pytest.fixture(scope="session")
def lineage() -> Lineage:
    return Lineage(base_model="micro", stage_runs={"sft": "run-sft", "dpo": "run-dpo"},
                   dataset_digests={"sft_train.jsonl": "ab" * 32}, git_commit="0" * 40)


@pytest.fixture(scope="session")
def session_bundle(model_dir, small_shard_size, lineage, tmp_path_factory) -> Path:
    """One bundle written per session; tests that tamper with it work on a copy (see `bundle`)."""
    out = tmp_path_factory.mktemp("bundles") / "tiny"
    config = BundleConfig(name="tiny", version="1.0.0", max_shard_size=small_shard_size, tp_degrees=[1, 2])
    return write_bundle(model_dir, out, config, lineage)


@pytest.fixture()
def bundle(session_bundle, tmp_path) -> Path:
    """A private copy of the session bundle, free to tamper with."""
    return Path(shutil.copytree(session_bundle, tmp_path / "bundle"))


@pytest.fixture()
def tracking_uri(tmp_path, monkeypatch) -> str:
    """A real MLflow store: sqlite backend and a local artifact root, both in tmp."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("MLFLOW_DEFAULT_ARTIFACT_ROOT", str(tmp_path / "mlartifacts"))
    return f"sqlite:///{tmp_path}/mlflow.db"


def _refresh_manifest(bundle: Path, mutate=None) -> None:
    """Re-digest every listed file and apply `mutate(dict)`: an attacker who also fixes the checksums.

    Tamper tests use it so the refusal comes from the structural check under test, not from sha256."""
    import json

    from artifacts.digests import sha256_file

    path = bundle / "manifest.json"
    data = json.loads(path.read_text())
    for entry in data["files"]:
        file = bundle / entry["path"]
        if file.is_file():
            entry["sha256"], entry["size"] = sha256_file(file), file.stat().st_size
    if mutate is not None:
        mutate(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


@pytest.fixture(scope="session")
def refresh_manifest():
    return _refresh_manifest


def make_quantized_dir(source: Path, out: Path, method: str = "gptq", bits: int = 4, group_size: int = 32) -> Path:
    """A checkpoint in gptqmodel's packed layout (GPTQ or AWQ-GEMM) derived from a fp model dir.

    The packed integers are random: these tests check that the writer copies packed tensors verbatim and
    that shapes agree with bits/group_size, not numerics. Real GPTQ/AWQ dirs come from quantize/."""
    import json

    from safetensors.torch import load_file, save_file

    from artifacts.model_spec import LinearSpec, QuantizationInfo, model_spec, quantized_shapes

    out.mkdir(parents=True)
    for item in source.iterdir():
        if item.is_file() and not item.name.startswith("model") and item.suffix != ".safetensors":
            shutil.copy2(item, out / item.name)
    config = json.loads((source / "config.json").read_text())
    spec = model_spec(config)
    quant = QuantizationInfo(method=method, bits=bits, group_size=group_size,
                             format="gptq" if method == "gptq" else "gemm")
    from artifacts.safetensors_io import source_weight_files

    state = {}
    for file in set(source_weight_files(source).values()):
        state.update(load_file(str(file)))
    generator = torch.Generator().manual_seed(0)
    packed = {}
    for name, tensor in state.items():
        prefix = name.removesuffix(".weight")
        lin: LinearSpec | None = spec.linears.get(prefix)
        if lin is None or prefix == "lm_head":
            packed[name] = tensor.to(torch.float16)
            continue
        for suffix, (kind, shape) in quantized_shapes(lin, quant).items():
            if kind == "I32":
                packed[f"{prefix}.{suffix}"] = torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32,
                                                             generator=generator)
            else:
                packed[f"{prefix}.{suffix}"] = torch.rand(shape, generator=generator).to(torch.float16)
    save_file(packed, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["dtype"] = "float16"
    config.pop("torch_dtype", None)
    qc = {"quant_method": method, "bits": bits, "group_size": group_size}
    qc.update({"desc_act": False, "sym": True, "checkpoint_format": "gptq"} if method == "gptq"
              else {"zero_point": True, "version": "gemm"})
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="session")
def make_quantized():
    return make_quantized_dir


@pytest.fixture(scope="session")
def foreign_tokenizer(tmp_path_factory):
    """Factory: a differently trained tokenizer with more tokens than `rows` (another model's)."""

    def make(rows: int) -> Path:
        import random

        rng = random.Random(1)
        words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                 for _ in range(3000)]
        corpus = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(400)]
        out = tmp_path_factory.mktemp("foreign_tokenizer")
        tokenizer = build_tokenizer(out, vocab_size=rows + 64, corpus=corpus)
        if len(tokenizer) <= rows:  # a small corpus may not yield enough merges: add tokens until it exceeds
            tokenizer.add_tokens([f"<extra_{i}>" for i in range(rows + 1 - len(tokenizer))])
            tokenizer.save_pretrained(str(out))
        assert len(tokenizer) > rows
        return out

    return make
