"""Device, precision and thread choices made from the hardware at run time, so one recipe runs on CPU and CUDA.

TRL's config defaults (bf16 on, gradient checkpointing on, pinned dataloader memory) fail or crawl on a CPU;
`trainer_hardware_kwargs` returns the TrainingArguments overrides that fit the machine the stage runs on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from artifacts.common.device import pick_device
from training.stage_config import TrainingError

__all__ = ["Hardware", "TrainingError", "check_4bit_support", "configure_threads", "detect_hardware",
           "trainer_hardware_kwargs"]


@dataclass(frozen=True)
class Hardware:
    device: str  # "cuda" or "cpu"
    bf16: bool  # train in bf16 autocast (only where the device supports it natively)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32


def detect_hardware() -> Hardware:
    """CUDA if present (bf16 when the GPU computes it natively: Ampere on), else CPU in fp32 (CPUs without native
    bf16 emulate it). torch's plain ``is_bf16_supported()`` also says yes for emulated bf16 on older GPUs, where
    autocast to bf16 runs several times slower than fp32; those train in fp32."""
    device = pick_device().type
    return Hardware(device=device, bf16=device == "cuda" and native_bf16())


def native_bf16() -> bool:
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # a torch without the argument
        return torch.cuda.get_device_capability() >= (8, 0)


def configure_threads() -> int:
    """Honour LIFECYCLE_TORCH_THREADS (one thread often beats two on a busy shared CPU); returns the count used."""
    wanted = os.environ.get("LIFECYCLE_TORCH_THREADS")
    if wanted:
        torch.set_num_threads(max(1, int(wanted)))
    return torch.get_num_threads()


def trainer_hardware_kwargs(hw: Hardware) -> dict:
    """TrainingArguments overrides that make TRL's configs correct for this machine."""
    return {
        "use_cpu": hw.device == "cpu",
        "bf16": hw.bf16,
        "fp16": False,
        "gradient_checkpointing": False,
        "dataloader_pin_memory": hw.device == "cuda",
        "dataloader_num_workers": 0,
    }


def _nf4_round_trip(device: str) -> None:
    """Quantize and dequantize one small tensor in NF4 on `device`; raises whatever bitsandbytes raises."""
    import bitsandbytes.functional as bnbf

    weights = torch.randn(64, 64, device=device)
    packed, state = bnbf.quantize_4bit(weights, quant_type="nf4")
    restored = bnbf.dequantize_4bit(packed, state, quant_type="nf4")
    if restored.shape != weights.shape or not torch.isfinite(restored).all():
        raise RuntimeError("NF4 round trip returned a wrong or non-finite tensor")


def check_4bit_support(hw: Hardware) -> None:
    """Fail before training when QLoRA is asked for on hardware bitsandbytes cannot serve."""
    try:
        _nf4_round_trip(hw.device)
    except Exception as exc:  # ImportError, missing native library, unsupported device...
        raise TrainingError(
            f"lora.qlora: 4-bit NF4 loading is not available on this machine ({hw.device}): "
            f"{type(exc).__name__}: {exc}. Set lora.qlora: false to train plain LoRA."
        ) from exc
