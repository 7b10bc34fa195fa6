"""Read a plain Llama-family checkpoint straight into the module tree the compact forward reads, without
transformers' modeling code.

Why: loading through ``AutoModelForCausalLM`` imports transformers' modeling stack, and with it, through its
integrations, ``torch._dynamo``, ``torch.distributed.tensor`` and torchao: about 5 s of the engine's 10 s start on
a 2-vCPU host, for a model whose forward the compact path (``compact_llama``) then replaces. Every replica start,
every ``lifecycle serve`` and every test server paid it.

What: a checkpoint is *plain* when its ``config.json`` names ``llama``, ``mistral`` or ``qwen2`` with SiLU MLPs,
no MLP bias, no sliding window, no quantization and rotary embeddings of the default kind or Llama 3's scaling,
and its weights are safetensors. Its tensors then load into bare ``torch.nn`` modules named as in
``LlamaForCausalLM`` (``model.layers[i].self_attn.q_proj``, ..., ``lm_head``, ``model.rotary_emb.inv_freq``),
with biases where the checkpoint has them (Qwen2's q/k/v), and a config namespace with the fields the runner reads.
Anything else returns None from ``load_plain`` and goes through transformers as before. The equivalence with
transformers' loading (logits, tied and untied heads, biases, Llama 3 rope) is tested.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

PLAIN_MODEL_TYPES = ("llama", "mistral", "qwen2")
_DEFAULT_EPS = 1e-6
_DEFAULT_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}  # each config class's own default


class CheckpointConfig(SimpleNamespace):
    """config.json's fields as attributes (what the runner and the compact forward read of a HF config)."""

    def get_text_config(self) -> CheckpointConfig:
        return self


def plain_reason(path: Path) -> str | None:
    """None when ``path`` holds a plain checkpoint this module loads, else why not."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"config.json unreadable ({e})"
    rope = _rope_parameters(cfg)
    checks = [
        (cfg.get("model_type") in PLAIN_MODEL_TYPES, f"model_type {cfg.get('model_type')!r}"),
        (cfg.get("quantization_config") is None, "quantized"),
        (cfg.get("hidden_act", "silu") == "silu", f"hidden_act {cfg.get('hidden_act')!r}"),
        (not cfg.get("mlp_bias", False), "mlp bias"),
        (not (cfg.get("sliding_window") and cfg.get("use_sliding_window", cfg.get("model_type") != "qwen2")),
         "sliding window"),
        (cfg.get("model_type") == "llama" or "num_key_value_heads" in cfg, "num_key_value_heads not given"),
        (rope.get("rope_type", "default") in ("default", "llama3"), f"rope type {rope.get('rope_type')!r}"),
        (cfg.get("partial_rotary_factor", 1.0) == 1.0, "partial rotary"),
        ((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file(),
         "no safetensors weights"),
    ]
    return next((why for ok, why in checks if not ok), None)


def load_plain(path: Path, dtype: torch.dtype, device: torch.device) -> nn.Module | None:
    """The checkpoint as a module tree shaped like ``LlamaForCausalLM`` (no forward of its own), or None when it
    is not plain (``plain_reason``) or its weights do not match its config."""
    if plain_reason(path) is not None:
        return None
    cfg = json.loads((path / "config.json").read_text())
    weights = _read_safetensors(path)
    heads = cfg["num_attention_heads"]
    config = CheckpointConfig(**{
        "num_key_value_heads": heads, "head_dim": None, "sliding_window": None,
        "max_position_embeddings": _DEFAULT_POSITIONS[cfg["model_type"]],
        "tie_word_embeddings": False, "rms_norm_eps": _DEFAULT_EPS, "quantization_config": None,
        "hidden_act": "silu", "mlp_bias": False, **cfg})
    config.head_dim = config.head_dim or config.hidden_size // heads
    tied = "lm_head.weight" not in weights
    if tied and not config.tie_word_embeddings:
        return None  # transformers would give this head random weights; let it say so
    expected = _expected_names(config.num_hidden_layers)
    if not expected <= set(weights):
        return None
    model = _skeleton(weights, config, tied)
    model.to(device=device, dtype=dtype)
    model.model.rotary_emb = _Rotary(config, device)  # float32, as transformers keeps it
    model.requires_grad_(False)
    return model.eval()


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(str(path / "model.safetensors"))
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(str(path / shard)))
    return weights


def _expected_names(layers: int) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(layers):
        p = f"model.layers.{i}."
        names |= {p + n + ".weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                                              "input_layernorm", "post_attention_layernorm")}
    return names


class _Linear(nn.Linear):
    """An ``nn.Linear`` around loaded tensors. Built without ``reset_parameters``: random init is wasted work, and
    on a meta tensor it goes through torch's reference ops, whose first use imports ``torch._dynamo`` (2.6 s)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


def _linear(weights: dict[str, torch.Tensor], name: str) -> nn.Linear:
    return _Linear(weights[name + ".weight"], weights.get(name + ".bias"))


class _RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon = eps


def _skeleton(weights: dict[str, torch.Tensor], config: CheckpointConfig, tied: bool) -> nn.Module:
    eps = float(config.rms_norm_eps)
    layers = nn.ModuleList()
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = nn.Module()
        layer.self_attn = nn.Module()
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(layer.self_attn, proj, _linear(weights, p + "self_attn." + proj))
        layer.mlp = nn.Module()
        for proj in ("gate_proj", "up_proj", "down_proj"):
            setattr(layer.mlp, proj, _linear(weights, p + "mlp." + proj))
        layer.input_layernorm = _RMSNorm(weights[p + "input_layernorm.weight"], eps)
        layer.post_attention_layernorm = _RMSNorm(weights[p + "post_attention_layernorm.weight"], eps)
        layers.append(layer)
    inner = nn.Module()
    embed = weights["model.embed_tokens.weight"]
    inner.embed_tokens = nn.Embedding(embed.shape[0], embed.shape[1], _weight=embed, _freeze=True)  # no init
    inner.layers = layers
    inner.norm = _RMSNorm(weights["model.norm.weight"], eps)
    model = nn.Module()
    model.model = inner
    model.lm_head = _Linear(embed if tied else weights["lm_head.weight"])
    if tied:
        model.lm_head.weight = inner.embed_tokens.weight  # one parameter, as transformers ties them
    model.config = config
    return model


def _rope_parameters(cfg: dict) -> dict:
    """The rotary settings, as transformers 5 (``rope_parameters``) or 4 (``rope_theta`` + ``rope_scaling``) write
    them."""
    params = dict(cfg.get("rope_parameters") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    for key, value in (cfg.get("rope_scaling") or {}).items():  # a scaling written the old way is meant
        params["rope_type" if key == "type" else key] = value
    params.setdefault("rope_type", "default")
    return params


class _Rotary(nn.Module):
    """``inv_freq`` and ``attention_scaling`` of transformers' rotary embedding, computed the way it computes them
    (default, and Llama 3's frequency-dependent scaling)."""

    def __init__(self, config: CheckpointConfig, device: torch.device) -> None:
        super().__init__()
        rope = _rope_parameters(vars(config))
        dim = config.head_dim
        base = float(rope["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
        if rope["rope_type"] == "llama3":
            inv_freq = _llama3_scaled(inv_freq, rope)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.attention_scaling = 1.0


def _llama3_scaled(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by ``factor``, short ones kept, a smooth blend between."""
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)
