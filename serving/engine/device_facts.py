"""What the engine needs to know about its device, and the dtype ``--dtype auto`` picks from it.

The decision is a pure function of plain facts (device type, compute capability, native bf16) so CPU CI can
test every branch with planted facts; ``probe`` reads the real ones from torch at load. Why these rules:
- bf16 wherever the GPU computes it natively (compute capability 8.0 and later: A100, H100, L4, RTX 30xx on):
  it has fp32's range, so a checkpoint trained in bf16 or fp32 cannot overflow, at half the bytes per weight
  and per KV entry, and decode is bound by those bytes;
- fp16 on older GPUs (V100, T4): torch would run bf16 there by emulation, several times slower than fp16;
- fp32 on CPU: our CPU kernels (paged attention, the int4 GEMM) take fp32, and every CPU figure in
  benchmarks/RESULTS.md is fp32.
An explicit ``--dtype bfloat16`` on a GPU without native bf16 is refused with one line rather than run
emulated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from artifacts.common.device import BF16_CAPABILITY, has_native_bf16
from serving.engine.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceFacts", "auto_dtype", "probe", "resolve_dtype"]



@dataclass(frozen=True)
class DeviceFacts:
    """The device as the dtype and memory decisions see it."""

    type: str  # torch's device type: "cpu", "cuda", "mps", ...
    capability: tuple[int, int] | None = None  # CUDA compute capability; None off CUDA
    bf16_native: bool = False  # the device computes bf16 itself (torch's check without emulation)
    name: str = ""  # for messages: "NVIDIA H100 80GB HBM3"

    def describe(self) -> str:
        if self.capability is None:
            return self.name or self.type
        return f"{self.name or self.type} (compute capability {self.capability[0]}.{self.capability[1]})"


def auto_dtype(facts: DeviceFacts) -> str:
    """``--dtype auto``: bf16 where the device has it natively, fp16 on other accelerators, fp32 on CPU."""
    if facts.type == "cpu":
        return "float32"
    return "bfloat16" if facts.bf16_native else "float16"


def resolve_dtype(requested: str, facts: DeviceFacts) -> str:
    """The dtype the engine runs in: ``requested`` as given, or ``auto_dtype``; a ModelLoadError (one line)
    for bf16 on a GPU that only emulates it."""
    if requested == "auto":
        return auto_dtype(facts)
    if requested == "bfloat16" and facts.type == "cuda" and not facts.bf16_native:
        need = ".".join(map(str, BF16_CAPABILITY))
        raise ModelLoadError(f"--dtype bfloat16: {facts.describe()} has no native bfloat16 (it needs compute "
                             f"capability {need} or later); use --dtype float16, or auto")
    return requested


def probe(device: torch.device) -> DeviceFacts:
    """The real facts of ``device`` (torch is asked once, at load)."""
    import torch

    if device.type != "cuda":
        return DeviceFacts(device.type)
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = tuple(torch.cuda.get_device_capability(index))
    return DeviceFacts("cuda", (capability[0], capability[1]), has_native_bf16(device),
                       torch.cuda.get_device_name(index))
