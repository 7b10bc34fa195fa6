"""What tensors a Llama-family config.json promises, and whether a checkpoint keeps that promise.

Why from the config and not from loading the model: the verifier must catch a shard whose tensor has the
wrong shape or dtype (or a tokenizer that outgrows the embedding) without building the model, and the
same rules serve the writer. Quantized linears (GPTQ / AWQ packed int32 tensors from gptqmodel) are
checked against the quantization config's bits and group size, so a checkpoint packed with other
settings than it claims is refused before a kernel reads garbage.

Layouts (K = in_features, N = out_features, pack = 32 // bits, G = ceil(K / group_size)):
- GPTQ (gptq / gptq_v2): qweight I32 [K/pack, N], qzeros I32 [G, N/pack], scales float [G, N], g_idx I32 [K]
- AWQ (gemm):            qweight I32 [K, N/pack], qzeros I32 [G, N/pack], scales float [G, N]
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from artifacts.manifest import ArchitectureSummary, QuantizationInfo
from artifacts.safetensors_io import CONFIG_DTYPES, FLOAT_DTYPES

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_QUANT = {"gptq": ("gptq", "gptq_v2"), "awq": ("gemm",)}
SUPPORTED_BITS = (2, 4, 8)
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


class SpecError(ValueError):
    """A config.json field is missing or unsupported; the message names the field."""


@dataclass
class LinearSpec:
    out_features: int
    in_features: int
    parallel: str  # "column" | "row"


@dataclass
class ModelSpec:
    arch: ArchitectureSummary
    dense: dict[str, list[int]]  # required non-linear tensors (embeddings, norms)
    optional: dict[str, list[int]]  # allowed extras (qwen3 q/k norms, a tied lm_head saved anyway)
    linears: dict[str, LinearSpec]  # module prefix -> spec (weight or quantized tensors expected)


def _need(config: dict[str, Any], key: str) -> Any:
    if key not in config or config[key] is None:
        raise SpecError(f"config.json: missing field {key}")
    return config[key]


def config_dtype(config: dict[str, Any]) -> str:
    """The float dtype config.json declares (transformers 5 writes `dtype`, older `torch_dtype`)."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in CONFIG_DTYPES:
        raise SpecError(f"config.json: dtype {name!r} is not a supported float dtype")
    return name


def architecture_summary(config: dict[str, Any]) -> ArchitectureSummary:
    model_type = _need(config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecError(f"config.json: model_type {model_type!r} is not a supported Llama-family type "
                        f"({', '.join(SUPPORTED_MODEL_TYPES)})")
    heads = int(_need(config, "num_attention_heads"))
    hidden = int(_need(config, "hidden_size"))
    return ArchitectureSummary(
        model_type=model_type,
        architectures=list(config.get("architectures") or []),
        num_layers=int(_need(config, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        hidden_size=hidden,
        intermediate_size=int(_need(config, "intermediate_size")),
        vocab_size=int(_need(config, "vocab_size")),
        max_position_embeddings=int(_need(config, "max_position_embeddings")),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        dtype=config_dtype(config),
    )


def model_spec(config: dict[str, Any]) -> ModelSpec:
    a = architecture_summary(config)
    q_out, kv_out = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    dense = {"model.embed_tokens.weight": [a.vocab_size, a.hidden_size], "model.norm.weight": [a.hidden_size]}
    optional: dict[str, list[int]] = {}
    if a.tie_word_embeddings:
        optional["lm_head.weight"] = [a.vocab_size, a.hidden_size]
    linears: dict[str, LinearSpec] = {}
    for i in range(a.num_layers):
        p = f"model.layers.{i}"
        dense[f"{p}.input_layernorm.weight"] = [a.hidden_size]
        dense[f"{p}.post_attention_layernorm.weight"] = [a.hidden_size]
        if a.model_type == "qwen3":
            dense[f"{p}.self_attn.q_norm.weight"] = [a.head_dim]
            dense[f"{p}.self_attn.k_norm.weight"] = [a.head_dim]
        linears[f"{p}.self_attn.q_proj"] = LinearSpec(q_out, a.hidden_size, "column")
        linears[f"{p}.self_attn.k_proj"] = LinearSpec(kv_out, a.hidden_size, "column")
        linears[f"{p}.self_attn.v_proj"] = LinearSpec(kv_out, a.hidden_size, "column")
        linears[f"{p}.self_attn.o_proj"] = LinearSpec(a.hidden_size, q_out, "row")
        linears[f"{p}.mlp.gate_proj"] = LinearSpec(a.intermediate_size, a.hidden_size, "column")
        linears[f"{p}.mlp.up_proj"] = LinearSpec(a.intermediate_size, a.hidden_size, "column")
        linears[f"{p}.mlp.down_proj"] = LinearSpec(a.hidden_size, a.intermediate_size, "row")
    if not a.tie_word_embeddings:
        linears["lm_head"] = LinearSpec(a.vocab_size, a.hidden_size, "column")
    return ModelSpec(a, dense, optional, linears)


def quantization_from_config(config: dict[str, Any]) -> QuantizationInfo | None:
    """Read config.json's `quantization_config`; refuse formats this bundle contract cannot verify."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in SUPPORTED_QUANT:
        raise SpecError(f"config.json: unsupported quantization format quant_method={method!r} "
                        f"(supported: {', '.join(SUPPORTED_QUANT)})")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or qc.get("version")
              or SUPPORTED_QUANT[method][0]).lower()
    if fmt not in SUPPORTED_QUANT[method]:
        raise SpecError(f"config.json: unsupported quantization format {method}/{fmt} "
                        f"(supported for {method}: {', '.join(SUPPORTED_QUANT[method])})")
    pack_dtype = str(qc.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        raise SpecError(f"config.json: unsupported quantization format {method} with pack_dtype {pack_dtype} "
                        "(only int32 packing is supported)")
    bits = qc.get("bits")
    if bits not in SUPPORTED_BITS:
        raise SpecError(f"config.json: unsupported quantization bits={bits!r} (supported: {SUPPORTED_BITS})")
    group_size = qc.get("group_size", qc.get("q_group_size", -1))
    if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
        raise SpecError(f"config.json: invalid quantization group_size={group_size!r}")
    sym = qc.get("sym")
    if sym is None and "zero_point" in qc:
        sym = not qc["zero_point"]
    return QuantizationInfo(method=method, bits=bits, group_size=group_size, sym=sym,
                            desc_act=qc.get("desc_act"), format=fmt)


def quantized_shapes(spec: LinearSpec, q: QuantizationInfo) -> dict[str, tuple[str, list[int]]]:
    """Expected (dtype class, shape) of each packed tensor of one quantized linear."""
    pack = 32 // q.bits
    k, n = spec.in_features, spec.out_features
    groups = math.ceil(k / (q.group_size if q.group_size > 0 else k))
    if q.method == "gptq":
        return {"qweight": ("I32", [k // pack, n]), "qzeros": ("I32", [groups, n // pack]),
                "scales": ("float", [groups, n]), "g_idx": ("I32", [k])}
    return {"qweight": ("I32", [k, n // pack]), "qzeros": ("I32", [groups, n // pack]),
            "scales": ("float", [groups, n])}


def check_layout(
    spec: ModelSpec, quant: QuantizationInfo | None, tensors: dict[str, tuple[str, list[int]]]
) -> tuple[str, str] | None:
    """First (tensor, reason) where `tensors` (name -> (dtype, shape)) break the config; None if sound."""
    want_float = CONFIG_DTYPES[spec.arch.dtype]
    seen: set[str] = set()

    def check(name: str, dtype_class: str, shape: list[int], required: bool = True) -> tuple[str, str] | None:
        if name not in tensors:
            return (name, "missing tensor required by config.json") if required else None
        seen.add(name)
        dtype, actual = tensors[name]
        if actual != shape:
            return name, f"shape {actual} does not match config.json (expected {shape})"
        if dtype_class == "float" and dtype not in FLOAT_DTYPES:
            return name, f"dtype {dtype} is not a float dtype"
        if dtype_class not in ("float", "any") and dtype != dtype_class:
            return name, f"dtype {dtype} does not match (expected {dtype_class})"
        return None

    # An unquantized float tensor must carry the dtype config.json declares; quantized checkpoints keep
    # their non-linear tensors in the config dtype too, scales may differ (fp16 in a bf16 model).
    for name, shape in spec.dense.items():
        if problem := check(name, want_float, shape):
            return problem
    for name, shape in spec.optional.items():
        if problem := check(name, want_float, shape, required=False):
            return problem
    for prefix, lin in spec.linears.items():
        if quant is not None and f"{prefix}.qweight" in tensors:
            if quant.group_size > 0 and lin.in_features % quant.group_size:
                reason = f"in_features {lin.in_features} not divisible by group_size {quant.group_size}"
                return f"{prefix}.qweight", reason
            pack = 32 // quant.bits
            if quant.method == "gptq" and lin.in_features % pack:
                return f"{prefix}.qweight", f"in_features {lin.in_features} not divisible by pack factor {pack}"
            if lin.out_features % pack:
                return f"{prefix}.qzeros", f"out_features {lin.out_features} not divisible by pack factor {pack}"
            for suffix, (dtype_class, shape) in quantized_shapes(lin, quant).items():
                if problem := check(f"{prefix}.{suffix}", dtype_class, shape):
                    claimed = f" for {quant.method} {quant.bits}-bit group_size {quant.group_size}"
                    return problem[0], problem[1] + claimed
            if problem := check(f"{prefix}.bias", "float", [lin.out_features], required=False):
                return problem
            # Some writers keep an unused g_idx on AWQ layers: allowed, but its shape is checked.
            awq_g_idx = quant.method == "awq" and check(f"{prefix}.g_idx", "I32", [lin.in_features], required=False)
            if awq_g_idx:
                return awq_g_idx
        else:
            if problem := check(f"{prefix}.weight", want_float, [lin.out_features, lin.in_features]):
                return problem
            if problem := check(f"{prefix}.bias", want_float, [lin.out_features], required=False):
                return problem
    for name in tensors:
        if name not in seen:
            return name, f"unexpected tensor for a {spec.arch.model_type} config"
    return None


_LAYER = re.compile(r"(\d+)")


def natural_key(name: str) -> list[Any]:
    """Sort layers 0, 1, 2, ..., 10 rather than 0, 1, 10, 2 so shards follow the network's order."""
    return [int(part) if part.isdigit() else part for part in _LAYER.split(name)]
