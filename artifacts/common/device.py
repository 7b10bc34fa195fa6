"""One answer to "where does this run?": the same torch code on CUDA when present, else on the CPU.

Every stage (base-model pretraining, training, quantization, evals, serving) takes a device setting that is
``"auto"`` by default; they all resolve it here so a recipe moved to a GPU host changes nothing but speed.
torch is imported inside the function, so importing this module stays as cheap as the rest of the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BF16_CAPABILITY", "has_native_bf16", "pick_device"]

# the first CUDA compute capability with bf16 tensor cores (Ampere)
BF16_CAPABILITY = (8, 0)


def pick_device(name: str | None = "auto") -> torch.device:
    """``"auto"`` (or None): CUDA when torch sees a GPU, else CPU; any other name (``"cpu"``, ``"cuda:1"``) as given."""
    import torch

    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def has_native_bf16(device: torch.device) -> bool:
    """The device computes bf16 itself: a CUDA GPU of compute capability 8.0 or later. torch's plain
    ``is_bf16_supported()`` also says yes for emulated bf16 on older GPUs, several times slower than fp16 or
    fp32 there; serving and training both decide from this instead."""
    import torch

    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        try:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # a torch without the argument: decide from the capability
            return tuple(torch.cuda.get_device_capability(index)) >= BF16_CAPABILITY
