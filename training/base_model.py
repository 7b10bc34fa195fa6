"""The embedded base model: tokenizer + Llama config + pretraining on the synthetic corpus.

Why embedded: the pipeline must run end to end with nothing downloaded, so it trains its own tiny Llama
in minutes. The result is a standard Hugging Face directory, cached under ``cache_root/<recipe digest>``:
the same recipe never trains twice, and any stage (or vLLM, or llama.cpp's converter) can open it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from artifacts.common.atomic import staged_directory
from artifacts.common.device import pick_device
from artifacts.digests import digest_json
from artifacts.errors import LifecycleError
from training.corpus import CorpusSpec, build_corpus
from training.shipped_base import ShippedBase, install_shipped, shipped_for, verify_files
from training.tokenizer import (
    ASSISTANT,
    CHAT_TEMPLATE,
    END,
    EOS,
    SYSTEM,
    USER,
    end_token_ids,
    train_tokenizer,
)
from training.window_training import WindowSchedule, train_on_windows

RECIPE_VERSION = 3  # bump when the corpus or training code changes what a recipe produces
PRETRAIN_LOG = "pretrain_log.json"
RECIPE_FILE = "recipe.json"

PRESETS: dict[str, dict[str, object]] = {
    "micro": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192,
                  steps=100, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=10,
                  chats_per_task=300, facts_per_task=100, first_task_repeats=1, safety_repeats=1,
                  plain_sentences=200),
    "default": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=512,
                    steps=400, batch_size=16, seq_len=128, lr=4e-3, warmup_steps=30,
                    chats_per_task=5000, facts_per_task=1000, first_task_repeats=3, safety_repeats=2,
                    plain_sentences=1000),
}


class BaseModelError(LifecycleError):
    """A base model source is unusable; the message names the path and what is missing."""


@dataclass
class BaseModelConfig:
    """Recipe of the embedded base model. ``None`` fields take the preset's value.

    ``threads`` and ``device`` ("auto" = CUDA when available) change speed,
    not the recipe, so they are not part of the cache digest. ``shipped`` says where the weights come from
    (``training.shipped_base``): the package's checkpoint of this recipe, or pretraining here.
    """

    preset: str = "default"
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    max_position_embeddings: int = 256
    vocab_size: int = 512
    tie_embeddings: bool = True
    steps: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None
    weight_decay: float = 0.01
    chats_per_task: int | None = None
    facts_per_task: int | None = None
    first_task_repeats: int | None = None
    safety_repeats: int | None = None
    plain_sentences: int | None = None
    tasks: list[str] = field(default_factory=lambda: ["addition", "reverse"])
    seed: int = 0
    threads: int = 1  # measured: 1 torch thread beat 2 on the shared 2-core host (0 = leave torch's choice)
    device: str = "auto"
    shipped: bool = True  # take the checkpoint shipped in the package when it was built from this very recipe

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset: unknown preset {self.preset!r} (known: {', '.join(PRESETS)})")
        for name, value in PRESETS[self.preset].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "steps", "batch_size", "seq_len", "max_position_embeddings", "vocab_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        for name in ("chats_per_task", "facts_per_task", "safety_repeats", "plain_sentences"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.first_task_repeats < 1:
            raise ValueError(f"first_task_repeats: must be >= 1, got {self.first_task_repeats}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads: {self.num_heads} does not divide hidden_size {self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError(f"seq_len: {self.seq_len} exceeds max_position_embeddings "
                             f"{self.max_position_embeddings}")
        if not self.lr or self.lr <= 0:
            raise ValueError(f"lr: must be positive, got {self.lr}")
        if self.warmup_steps < 0 or self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps: must be in [0, steps], got {self.warmup_steps}")
        if self.threads < 0:
            raise ValueError(f"threads: must be >= 0, got {self.threads}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: must be auto, cpu or cuda, got {self.device!r}")

    def recipe(self) -> dict[str, object]:
        """Everything that changes the trained weights (what the cache key is made of)."""
        speed_only = ("preset", "threads", "device", "shipped")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in speed_only}
        out["recipe_version"] = RECIPE_VERSION
        return out

    def digest(self) -> str:
        return digest_json(self.recipe())

    def llama_config_kwargs(self, vocab_size: int | None = None) -> dict[str, Any]:
        """The architecture fields of the `LlamaConfig` this recipe trains, known without training it.

        `vocab_size` is the trained tokenizer's size padded to a multiple of 64; before training, the
        recipe's `vocab_size` padded the same way stands in (the BPE trainer's target size)."""
        return dict(
            vocab_size=vocab_size if vocab_size is not None else -(-self.vocab_size // 64) * 64,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_embeddings,
        )

    def corpus_spec(self) -> CorpusSpec:
        return CorpusSpec(tasks=tuple(self.tasks), chats_per_task=self.chats_per_task,
                          facts_per_task=self.facts_per_task,
                          first_task_repeats=self.first_task_repeats, safety_repeats=self.safety_repeats,
                          plain_sentences=self.plain_sentences, seed=self.seed)


@dataclass
class BaseModelBuild:
    """What `ensure_base_model` did: where the model is, whether it came from the cache, and its origin
    (``shipped``: the package's checkpoint; ``pretrained``: trained on this host)."""

    path: Path
    cached: bool
    seconds: float
    origin: str = "pretrained"


def default_cache_root() -> Path:
    """``<workdir>/models/base``, the same place the flow's base stage caches into."""
    from artifacts.common.workdir import resolve_workdir

    return resolve_workdir().models / "base"


def build_base_model(config: BaseModelConfig, cache_root: Path | str | None = None) -> Path:
    """The HF directory of the model ``config`` describes, trained now or taken from the cache."""
    return ensure_base_model(config, cache_root).path


def shipped_checkpoint(config: BaseModelConfig) -> ShippedBase | None:
    """The package's checkpoint when ``config`` asks for it (``shipped``) and it was built from this recipe."""
    return shipped_for(config.digest()) if config.shipped else None


def ensure_base_model(config: BaseModelConfig, cache_root: Path | str | None = None) -> BaseModelBuild:
    """The base model of ``config`` under ``cache_root``: the shipped checkpoint installed (and checked against
    its sha256s) when it was built from this recipe, else pretrained here; either is cached. The two never
    share a directory, so a model pretrained here is never mistaken for the shipped one."""
    start = time.perf_counter()
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    shipped = shipped_checkpoint(config)
    origin = "shipped" if shipped is not None else "pretrained"
    target = root / (config.digest()[:16] if shipped is None else f"shipped-{shipped.weights_sha256[:16]}")
    if _is_complete(target):
        if shipped is not None:
            verify_files(target, shipped.files)
        return BaseModelBuild(target, cached=True, seconds=time.perf_counter() - start, origin=origin)
    # "keep": when two runs build the same base model at once, the first to finish wins; theirs is as good
    # as ours (same config digest, same seed).
    with staged_directory(target, if_exists="keep") as tmp:
        if shipped is not None:
            install_shipped(shipped, tmp)
        else:
            _train_into(config, tmp)
    return BaseModelBuild(target, cached=False, seconds=time.perf_counter() - start, origin=origin)


def _is_complete(path: Path) -> bool:
    return (path / RECIPE_FILE).is_file() and (path / "model.safetensors").is_file()


def warmup_cosine_lr(step: int, *, lr: float, steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` (pretraining and draft distillation)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    floor = lr * min_lr_ratio
    return floor + 0.5 * (lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def _lr_at(step: int, config: BaseModelConfig) -> float:
    return warmup_cosine_lr(step, lr=config.lr, steps=config.steps, warmup_steps=config.warmup_steps,
                            min_lr_ratio=config.min_lr_ratio)


def _train_into(config: BaseModelConfig, out_dir: Path) -> None:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    previous_threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        torch.manual_seed(config.seed)
        docs = build_corpus(config.corpus_spec())
        tokenizer = train_tokenizer(docs, vocab_size=config.vocab_size)
        stream = torch.tensor(
            [i for ids in tokenizer(docs, add_special_tokens=False)["input_ids"] for i in ids],
            dtype=torch.long)
        if len(stream) <= config.seq_len + 1:
            raise ValueError(f"seq_len: corpus has only {len(stream)} tokens, fewer than seq_len")

        bos_id, eos_id = tokenizer.convert_tokens_to_ids("<s>"), tokenizer.convert_tokens_to_ids(EOS)
        end_id = tokenizer.convert_tokens_to_ids(END)
        model_config = LlamaConfig(
            **config.llama_config_kwargs(vocab_size=-(-len(tokenizer) // 64) * 64),  # padded for kernels
            bos_token_id=bos_id, eos_token_id=[end_id, eos_id], pad_token_id=tokenizer.pad_token_id,
            rms_norm_eps=1e-5,
        )
        device = pick_device(config.device)
        model = LlamaForCausalLM(model_config).to(device)
        log = _pretrain(model, stream, config, device)

        model = model.to("cpu").float()
        model.generation_config = GenerationConfig(
            bos_token_id=bos_id, eos_token_id=end_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id,
            do_sample=False)
        model.save_pretrained(str(out_dir))
        save_hf_tokenizer(tokenizer, out_dir)
        log.update(corpus_documents=len(docs), corpus_tokens=len(stream),
                   parameters=sum(p.numel() for p in model.parameters()))
        (out_dir / PRETRAIN_LOG).write_text(json.dumps(log, indent=1))
        recipe = {"digest": config.digest(), "preset": config.preset, "recipe": config.recipe()}
        (out_dir / RECIPE_FILE).write_text(json.dumps(recipe, indent=1, sort_keys=True))
    finally:
        torch.set_num_threads(previous_threads)


def save_hf_tokenizer(tokenizer, out_dir: Path) -> None:
    """Save, then make tokenizer_config.json portable: the chat template inside it (the contract's place;
    transformers 5 otherwise writes only chat_template.jinja) and class/special-token keys that older
    transformers, vLLM and llama.cpp's converter read too."""
    tokenizer.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["additional_special_tokens"] = [SYSTEM, USER, ASSISTANT, END]
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def _pretrain(model, stream: torch.Tensor, config: BaseModelConfig, device: torch.device,
              on_log: Callable[[int, Any], None] | None = None) -> dict:
    """Next-token training on random windows of the packed token stream (``training.window_training``).

    ``on_log(step, model)`` runs at every log point (recipe tuning scripts check greedy accuracy there).
    """
    schedule = WindowSchedule(steps=config.steps, batch_size=config.batch_size, seq_len=config.seq_len,
                              lr=config.lr, weight_decay=config.weight_decay, seed=config.seed, log_points=100,
                              label=f"pretrain {config.preset}")
    log = train_on_windows(model, stream, schedule, lambda lm, batch: lm(input_ids=batch, labels=batch).loss,
                           lambda step: _lr_at(step, config), device, on_log)
    log["train_seconds"] = log.pop("seconds")
    return log | {"threads": torch.get_num_threads(), "device": str(device), "config": asdict(config)}


# --- resolving a user's choice ----------------------------------------------------------------------------

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def validate_model_dir(path: Path, what: str = "base model") -> Path:
    """Check that ``path`` is a loadable causal-LM directory; BaseModelError says what is missing.

    ``what`` starts every message (``base model``, or e.g. ``draft target`` for another stage's input)."""
    if not path.exists():
        alternative = " (and not 'embedded')" if what == "base model" else ""
        raise BaseModelError(f"{what} {path}: no such directory{alternative}")
    if not path.is_dir():
        raise BaseModelError(f"{what} {path}: not a directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise BaseModelError(f"{what} {path}: missing config.json")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BaseModelError(f"{what} {path}: config.json is not valid JSON ({exc})") from None
    if "model_type" not in raw:
        raise BaseModelError(f"{what} {path}: config.json has no model_type")
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except (ValueError, OSError, KeyError) as exc:
        raise BaseModelError(f"{what} {path}: config.json does not load ({exc})") from None
    if hf_config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise BaseModelError(f"{what} {path}: model_type {hf_config.model_type!r} is not a causal LM")
    if not any((path / name).is_file() for name in _WEIGHT_FILES) and not list(path.glob("*.safetensors")):
        raise BaseModelError(f"{what} {path}: missing weights (model.safetensors or an index)")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise BaseModelError(f"{what} {path}: missing tokenizer (tokenizer.json)")
    return path
