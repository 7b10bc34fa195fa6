"""Serve a GPTQ/AWQ snapshot through the compact fast path: its 4-bit weights, dequantized once at load.

Why: the quantized modules of gptqmodel run each projection as unpack-then-matmul on every call, through
the Hugging Face forward; on CPU that made the 4-bit bundle (the one the default recipe ships) the slowest
snapshot we could serve (0.35x the fp bundle's throughput at 16 concurrent requests). Dequantizing every
quantized linear once, with the library's own ``dequantize_weight``, gives plain fp32 ``nn.Linear`` layers
holding exactly the values the 4-bit grid encodes, so the engine's compact forward and CPU kernels apply
and the replies are the quantized model's. The price is memory: the weights take fp32 room again. A
packed int4 matmul would keep them small; see ``benchmarks/RESULTS.md`` for why it does not pay yet on CPU.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

__all__ = ["dequantize_linears", "is_quantized"]


def is_quantized(model: torch.nn.Module) -> bool:
    return getattr(model.config, "quantization_config", None) is not None


def _dequantizer(module: torch.nn.Module):
    """gptqmodel's own dequantization of a quantized linear ([in, out] weights), or None for other modules.

    Called before the module's first forward: on CPU that forward repacks the weights for torch's int4 kernel.
    """
    if not (hasattr(module, "in_features") and hasattr(module, "out_features")):
        return None
    if hasattr(module, "awq_weight_dequantize"):  # AWQ's packing order differs from GPTQ's
        return lambda: module.awq_weight_dequantize(device=module.scales.device, dtype=torch.float32)
    if hasattr(module, "dequantize_weight"):
        return module.dequantize_weight
    return None


def _quantized_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if _dequantizer(module) is not None]


def dequantize_linears(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Replace each quantized linear of ``model`` by an ``nn.Linear`` with its dequantized weights; returns
    how many were replaced, and drops ``quantization_config`` from the config when all of them were."""
    replaced = 0
    for name, module in _quantized_linears(model):
        with torch.no_grad():
            weight = _dequantizer(module)().T  # gptqmodel's layout is [in, out]; nn.Linear's [out, in]
        shape = (module.out_features, module.in_features)
        if tuple(weight.shape) != shape:
            raise ValueError(f"{name}: dequantized weight {tuple(weight.shape)} does not fit {shape}")
        bias = getattr(module, "bias", None)
        linear = torch.nn.Linear(module.in_features, module.out_features, bias=bias is not None,
                                 device=weight.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(weight.to(dtype))
            if bias is not None:
                linear.bias.copy_(bias.to(dtype))
        linear.requires_grad_(False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, linear)
        replaced += 1
    if replaced and not _quantized_linears(model):
        config = model.config.quantization_config
        method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
        log.info("%s checkpoint: %d projections dequantized to %s for the compact forward", method, replaced,
                 str(dtype).removeprefix("torch."))
        del model.config.quantization_config
    return replaced
