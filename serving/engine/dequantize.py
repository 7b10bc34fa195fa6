"""Serve a GPTQ/AWQ snapshot through the compact fast path: its quantized projections become plain ``nn.Linear``.

Why: the quantized modules of gptqmodel run each projection as unpack-then-matmul on every call, through
the Hugging Face forward; on CPU that made the 4-bit bundle (the one the default recipe ships) the slowest
snapshot we could serve (0.35x the fp bundle's throughput at 16 concurrent requests). Dequantizing every
quantized linear once, with the library's own ``dequantize_weight``, gives ``nn.Linear`` layers holding exactly
the values the 4-bit grid encodes, so the engine's compact forward applies and the replies are the quantized
model's. Each replaced layer's per-group scales are handed back with it: the compact forward repacks the layer
into 4-bit codes for ``serving.engine.int4_linear`` (so the weights stay 4-bit in memory and decode reads an
eighth of the fp32 bytes) and frees the fp32 copy; a layer it cannot repack keeps the fp32 weights.
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


def _group_scales(module: torch.nn.Module) -> torch.Tensor | None:
    """The layer's per-group scales as [out, groups] fp32 (gptqmodel keeps [groups, out]), or None."""
    scales = getattr(module, "scales", None)
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2 or scales.shape[1] != module.out_features:
        return None
    return scales.detach().T.float().contiguous()


def dequantize_linears(model: torch.nn.Module,
                       dtype: torch.dtype = torch.float32) -> dict[torch.nn.Linear, torch.Tensor | None]:
    """Replace each quantized linear of ``model`` by an ``nn.Linear`` with its dequantized weights; returns the
    new layers with their per-group scales ([out, groups], None where the module has none in the usual layout),
    and drops ``quantization_config`` from the config when every quantized layer was replaced."""
    replaced: dict[torch.nn.Linear, torch.Tensor | None] = {}
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
        replaced[linear] = _group_scales(module)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, linear)
    if replaced and not _quantized_linears(model):
        config = model.config.quantization_config
        method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
        log.info("%s checkpoint: %d projections dequantized to %s for the compact forward", method, len(replaced),
                 str(dtype).removeprefix("torch."))
        del model.config.quantization_config
    return replaced
