"""Which CPU GEMM library runs the compact path's fp32 projections: MKL with packed weights, or oneDNN's.

Why: both libraries ship inside torch's x86 wheels and both can hold a weight in a packed layout prepared
once at load time. On Intel CPUs MKL's packed sgemm (``mkl::_mkl_linear``, the op inductor uses for frozen
fp32 linears) beats oneDNN's packed inner product at every row count the engine runs: 1.1-2.3x at one row
(a batch-1 decode), 4-22% at 64 rows (a 64-stream decode step), up to 6% at 512 (a prefill chunk), one
projection at a time on 2 threads. On an AMD CPU MKL's sgemm was the slower of the two (unpacked ``F.linear``
against packed oneDNN, every projection of one forward: 3% slower at one row, 2.4-3.4x from 4 rows up), so
there oneDNN stays.

MKL packs B for an ``m`` given at packing time, and ``mkl::_mkl_linear`` only uses the packed weight when
called with that same ``m``; torch passes the row count through, so the engine passes every call's own row
count. That a packed B serves any ``m`` is MKL's behaviour, not its documented contract, so before the first
weight is packed ``mkl_packed_works`` checks it against ``F.linear`` at several row counts in this process and
the engine falls back to oneDNN if it does not hold.

``LLM_LIFECYCLE_CPU_GEMM=onednn`` (or ``mkl``) in the environment overrides the choice, for A/B runs and as a way
out should a torch build's MKL misbehave; ``auto`` (the default) chooses as above.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from artifacts.common.host import cpuinfo_field

__all__ = ["GEMM_ENV", "MKL_PACK_ROWS", "cpu_vendor", "mkl_packed_works", "use_mkl_packed"]

GEMM_ENV = "LLM_LIFECYCLE_CPU_GEMM"

MKL_PACK_ROWS = 64  # the row count weights are packed for (any row count is then served; see above)


def cpu_vendor() -> str:
    """``GenuineIntel``, ``AuthenticAMD``, ... from /proc/cpuinfo; "" where it cannot be read."""
    return cpuinfo_field("vendor_id")


@functools.cache
def mkl_packed_works() -> bool:
    """MKL's packed sgemm is in this torch, and a weight packed once gives F.linear's result for any row count."""
    if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(72, 40, generator=g)
    b = torch.randn(72, generator=g)
    try:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, MKL_PACK_ROWS)
        for rows in (1, 5, 63, 64, 65, 200):
            x = torch.randn(rows, 40, generator=g)
            y = torch.ops.mkl._mkl_linear(x, packed, w, b, rows)
            if not torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4):
                return False
    except (RuntimeError, NotImplementedError):
        return False
    return True


def use_mkl_packed(w: torch.Tensor) -> bool:
    """MKL's packed sgemm for ``w``: an fp32 CPU weight, on an Intel CPU (or with the override), where the
    check above holds."""
    choice = os.environ.get(GEMM_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "mkl", "onednn"):
        raise ValueError(f"{GEMM_ENV}: expected auto, mkl or onednn, got {choice!r}")
    if choice == "onednn" or w.device.type != "cpu" or w.dtype != torch.float32:
        return False
    return (choice == "mkl" or cpu_vendor() == "GenuineIntel") and mkl_packed_works()
