"""The quantize recipe: one dataclass that maps 1:1 to the `quantize:` block of a YAML recipe.

Field validation happens in `__post_init__` (ValueError naming the field). Checks that need the
model (does the group size divide every linear layer's in-features?) live in `check_model_compat`,
called before any heavy work so a bad recipe fails in milliseconds, not after calibration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from quantize.errors import QuantizeError

SUPPORTED_METHODS = ("gptq", "awq")
SUPPORTED_BITS = {"gptq": (2, 3, 4, 8), "awq": (4,)}
# gptqmodel's AWQ clip search walks output channels in blocks of 64 (or 256) and asserts divisibility.
AWQ_OUT_FEATURES_MULTIPLE = 64


@dataclass
class QuantizeConfig:
    """What to quantize and how; defaults are the embedded recipe's."""

    methods: list[str] = field(default_factory=lambda: ["gptq", "awq"])
    bits: int = 4
    group_size: int = 128  # -1 = one group per output channel (per-channel scales)
    calibration_samples: int = 128
    calibration_seq_len: int = 256
    # calibration windows per forward pass inside gptqmodel: at 1 its per-window Python dominated a small model
    # (embedded model, 48 windows: GPTQ 73 -> 12.5 / 14.5 s, AWQ 174 -> 77 / 49 s at 16 / 48, the same AWQ
    # and a lower GPTQ KL, benchmarks/RESULTS.md "Quantization fidelity"); a batch takes that many windows'
    # activations at once
    calibration_batch_size: int = 32
    sym: bool = True  # GPTQ and the RTN baseline; AWQ always uses zero-point (asymmetric) quantization
    desc_act: bool = False
    gate_gptq_beats_rtn: bool = True
    fidelity_samples: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.methods, list) or not self.methods:
            raise ValueError("methods: must be a non-empty list, e.g. ['gptq', 'awq']")
        unknown = [m for m in self.methods if m not in SUPPORTED_METHODS]
        if unknown:
            raise ValueError(f"methods: unknown method(s) {unknown}; supported: {list(SUPPORTED_METHODS)}")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods: duplicates in {self.methods}")
        if not isinstance(self.bits, int) or isinstance(self.bits, bool):
            raise ValueError(f"bits: must be an integer, got {self.bits!r}")  # noqa: TRY004 (contract: ValueError)
        for method in self.methods:
            if self.bits not in SUPPORTED_BITS[method]:
                raise ValueError(f"bits: {method} supports {list(SUPPORTED_BITS[method])}, got {self.bits}")
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool):
            raise ValueError(f"group_size: must be an integer, got {self.group_size!r}")  # noqa: TRY004
        if self.group_size != -1 and (self.group_size < 8 or self.group_size & (self.group_size - 1)):
            raise ValueError(f"group_size: must be -1 (per channel) or a power of two >= 8, got {self.group_size}")
        for name in ("calibration_samples", "fidelity_samples", "calibration_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not isinstance(self.calibration_seq_len, int) or self.calibration_seq_len < 16:
            raise ValueError(f"calibration_seq_len: must be an integer >= 16, got {self.calibration_seq_len!r}")


def _linear_shapes(model_config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of the decoder's projections for Llama/Qwen/Mistral-style configs."""
    hidden = int(model_config["hidden_size"])
    heads = int(model_config["num_attention_heads"])
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    head_dim = int(model_config.get("head_dim") or hidden // heads)
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }
    inter = model_config.get("intermediate_size")
    if inter:
        inter = int(inter)
        shapes.update({"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)})
    return shapes


def check_model_compat(config: QuantizeConfig, model_config: Mapping[str, Any], source: str = "config.json") -> None:
    """Raise QuantizeError if the recipe cannot apply to this architecture (before any heavy work)."""
    missing = [k for k in ("hidden_size", "num_attention_heads") if k not in model_config]
    if missing:
        raise QuantizeError(f"{source}: missing {missing}; only decoder-only transformer configs can be quantized")
    shapes = _linear_shapes(model_config)
    if config.group_size != -1:
        bad = {name: inf for name, (inf, _) in shapes.items() if inf % config.group_size}
        if bad:
            raise QuantizeError(
                f"{source}: group_size {config.group_size} does not divide the in-features of {bad}; "
                "choose a group size that divides them (or -1 for per-channel)"
            )
    if "awq" in config.methods:
        bad = {
            name: outf
            for name, (_, outf) in shapes.items()
            if name not in ("q_proj", "k_proj") and outf % AWQ_OUT_FEATURES_MULTIPLE
        }
        if bad:
            raise QuantizeError(
                f"{source}: AWQ (gptqmodel's clip search) needs out-features that are multiples of "
                f"{AWQ_OUT_FEATURES_MULTIPLE}, but {bad}; drop 'awq' from methods for this model"
            )
