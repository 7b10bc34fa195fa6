"""Round-to-nearest (RTN) baseline: the same bits, group size and grid as GPTQ, without GPTQ's
error compensation. It answers "did GPTQ/AWQ buy anything over plain rounding?".

The output is a normal full-precision HF directory whose Linear weights are *fake-quantized*
(quantized then dequantized back to fp32). It loads anywhere and compares like for like, but it
is a baseline for the fidelity report, not a shipping format: its size on disk is the fp32 size.
`rtn_baseline.json` beside the weights says so; config.json carries no `quantization_config`.

Grid (mirrors GPTQ's quantizer so only the rounding algorithm differs):
asymmetric: scale = (max - min) / (2^bits - 1), zero = round(-min / scale);
symmetric:  max = max(|min|, |max|), scale = 2*max / (2^bits - 1), zero = 2^(bits-1);
q = clamp(round(w / scale) + zero, 0, 2^bits - 1), w' = scale * (q - zero), per group of
`group_size` consecutive input features (per output row if group_size == -1).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from artifacts.common.atomic import staged_directory
from quantize.config import QuantizeConfig
from quantize.outputs import copy_sidecars

log = logging.getLogger(__name__)


def rtn_quantize(
    weight: torch.Tensor, bits: int, group_size: int, sym: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer codes, scales and zeros of a [out, in] weight; scales/zeros are [out, n_groups]."""
    out_f, in_f = weight.shape
    g = in_f if group_size == -1 else group_size
    if in_f % g:
        raise ValueError(f"group_size: {g} does not divide in-features {in_f}")
    w = weight.detach().float().reshape(out_f, in_f // g, g)
    maxq = 2**bits - 1
    wmin = w.amin(dim=-1).clamp(max=0.0)
    wmax = w.amax(dim=-1).clamp(min=0.0)
    if sym:
        wmax = torch.maximum(wmin.abs(), wmax)
        wmin = -wmax
    span = wmax - wmin
    # An all-zero group: any positive scale represents it exactly.
    scale = torch.where(span > 0, span / maxq, torch.ones_like(span))
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-wmin / scale)
    q = torch.clamp(torch.round(w / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, maxq)
    return q.reshape(out_f, in_f), scale, zero


def rtn_dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    out_f, in_f = q.shape
    g = in_f if group_size == -1 else group_size
    w = (q.reshape(out_f, in_f // g, g) - zero.unsqueeze(-1)) * scale.unsqueeze(-1)
    return w.reshape(out_f, in_f)


def fake_quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    """Quantize then dequantize, in the weight's dtype."""
    q, scale, zero = rtn_quantize(weight, bits, group_size, sym)
    return rtn_dequantize(q, scale, zero, group_size).to(weight.dtype)


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linear layers GPTQ/AWQ quantize: every Linear except the output head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}


def quantize_rtn(model_dir: Path, out_dir: Path, config: QuantizeConfig) -> Path:
    """Write the RTN fake-quantized copy of `model_dir` to `out_dir` (temp dir + rename)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    linears = quantizable_linears(model)
    with torch.no_grad():
        for module in linears.values():
            module.weight.copy_(fake_quantize(module.weight, config.bits, config.group_size, config.sym))
    log.info("rtn: rounded %d linear layers to %d bits, group size %d", len(linears), config.bits, config.group_size)
    with staged_directory(out_dir) as tmp:
        model.save_pretrained(tmp)
        copy_sidecars(Path(model_dir), tmp)
        meta = {
            "method": "rtn",
            "format": "fake-quantized fp32 (baseline only, not a shipping format)",
            "bits": config.bits,
            "group_size": config.group_size,
            "sym": config.sym,
            "layers": sorted(linears),
        }
        (tmp / "rtn_baseline.json").write_text(json.dumps(meta, indent=2) + "\n")
    return Path(out_dir)
