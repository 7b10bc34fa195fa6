"""Build (once) the serving-benchmark model: a seeded random-init tiny Llama saved as a local HF dir.

Random weights are enough for throughput and latency: every request sets ``ignore_eos`` so output
lengths are fixed by the workload, not by what the model says. The shape (hidden 512, 8 layers, 8 query /
2 KV heads, vocab 8192) is that of ``benchmarks/RESULTS.md``, so new figures compare with the recorded ones.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "out" / "bench-llama-h512-l8"
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


@dataclass
class BenchModelSpec:
    """Shape of the benchmark model (about 30M parameters, ~123 MB in fp32)."""

    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    intermediate_size: int = 1408
    vocab_size: int = 8192
    max_position_embeddings: int = 2048
    seed: int = 0


def _corpus(seed: int, n_lines: int = 20000) -> list[str]:
    """Synthetic text with a Zipf-ish word distribution, enough for BPE to fill an 8k vocabulary."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(6000)]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    lines = []
    for _ in range(n_lines):
        n = rng.randint(5, 25)
        lines.append(" ".join(rng.choices(words, weights, k=n)) + rng.choice([".", "?", "!", ","]))
    return lines


def _train_tokenizer(spec: BenchModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = (
        "<s>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    fast.save_pretrained(out)


def build_bench_model(model_dir: Path = DEFAULT_MODEL_DIR, spec: BenchModelSpec | None = None) -> Path:
    """Return ``model_dir``, building it first if it does not hold this exact spec yet."""
    spec = spec or BenchModelSpec()
    marker = model_dir / "bench_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return model_dir
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tmp = model_dir.with_name(model_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(spec, tmp)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, torch_dtype="float32", rope_theta=10000.0,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.save_pretrained(tmp, safe_serialization=True)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(tmp)
    (tmp / "bench_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    if model_dir.exists():
        import shutil

        shutil.rmtree(model_dir)
    tmp.rename(model_dir)
    return model_dir


def build_quantized_bench_model(method: str = "gptq", source: Path = DEFAULT_MODEL_DIR,
                                group_size: int = 128) -> Path:
    """The bench model quantized to 4 bits by the project's quantize package (gptqmodel), built once beside it.

    Calibration text is the bench tokenizer's own synthetic corpus. The weights are random, so what this model
    says means nothing; what it costs to serve is what a 4-bit snapshot of this shape costs.
    """
    import tempfile

    from quantize.calibration import build_calibration_set
    from quantize.config import QuantizeConfig

    source = build_bench_model(source)
    out = source.with_name(f"{source.name}-{method}-g{group_size}")
    if (out / "config.json").is_file():
        return out
    from transformers import AutoTokenizer

    if method == "gptq":
        from quantize.gptq import quantize_gptq as quantize
    elif method == "awq":
        from quantize.awq import quantize_awq as quantize
    else:
        raise ValueError(f"method: 'gptq' or 'awq', got {method!r}")
    with tempfile.TemporaryDirectory(prefix="bench-calibration-") as tmp:
        texts = Path(tmp) / "calibration.jsonl"
        texts.write_text("".join(json.dumps({"text": line}) + "\n" for line in _corpus(1, 512)))
        calibration = build_calibration_set(texts, AutoTokenizer.from_pretrained(str(source)), num_samples=64,
                                            seq_len=256)
        config = QuantizeConfig(bits=4, group_size=group_size, calibration_samples=64, calibration_seq_len=256)
        return quantize(source, out, calibration, config)  # writes a temporary directory, then renames it


def tensor_bytes(model_dir: Path) -> dict[str, int]:
    """Bytes of each tensor in the checkpoint's safetensors files, by name."""
    from safetensors import safe_open

    sizes = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                t = sf.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                sizes[k] = n * {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "U8": 1, "I8": 1}.get(t.get_dtype(), 4)
    return sizes


def weight_bytes(model_dir: Path) -> int:
    """Bytes of every tensor in the checkpoint: what one decode step must stream from memory."""
    return sum(tensor_bytes(model_dir).values())


def decode_read_bytes(model_dir: Path) -> int:
    """Bytes one batch-1 decode step reads: every tensor but the input embedding, of which a step reads one row
    (unless the head is tied to it and reads it all). The bench model: 106.8 MB."""
    sizes = tensor_bytes(model_dir)
    tied = not any(name.endswith("lm_head.weight") for name in sizes)
    return sum(n for name, n in sizes.items() if tied or not name.endswith("embed_tokens.weight"))


if __name__ == "__main__":
    d = build_bench_model()
    print(d, weight_bytes(d) / 1e6, "MB")
