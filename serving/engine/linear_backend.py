"""Which GEMM runs the compact path's fp32 projections on CPU: MKL's packed sgemm, oneDNN's packed inner product, or
our own tiled kernel (``csrc/tiled_gemm.cpp``).

Why three: each was the fastest somewhere, measured one projection at a time through ``DenseLinear`` on 2 threads.
- **Intel CPUs: MKL with packed weights** (``mkl::_mkl_linear``, the op inductor uses for frozen fp32 linears). It
  beat oneDNN's packed inner product at every row count the engine runs: 1.1-2.3x at one row (a batch-1 decode),
  4-22% at 64 rows, up to 6% at 512; the bench model's batch-1 decode ran at its DRAM floor (0.99x).
- **Other x86 CPUs (AMD) with AVX2 + FMA: the tiled kernel.** There MKL's sgemm was the slower library, and oneDNN's
  GEMV read the weights at 10-11 GB/s (AMD EPYC, AVX2 only, 2026-11-29): a batch-1 decode step spent ~10 ms in the
  projections. Our kernel holds each weight in 8-column tiles, one contiguous stream per tile, and reads it at
  18-21 GB/s. With several rows, each register block prefetches the next block's weights while it computes. Against
  oneDNN's time: 0.57-0.61x at one row, 0.46-0.51x at 16 rows, 0.81-0.86x at 64; at 512 rows (prefill chunks)
  0.99-1.24x, a cost paid once per prompt against a gain on every token (``benchmarks/cpu_gemm.py``; RESULTS.md,
  "Batch-1 decode", AMD).
  Where the build has AVX-512 (AMD Zen 4) the tiles are 16 columns and the register blocks up to 12 rows: 0.85-0.88x
  the 8-lane kernel's time from 16 to 512 rows, 0.95-0.99x at one row (RESULTS.md, "On AMD with AVX-512").
- **oneDNN** elsewhere: bf16 where it supports it, fp32 when the kernels cannot be built (no compiler, no AVX2,
  ``LLM_LIFECYCLE_CPU_KERNELS=0``).

MKL packs B for an ``m`` given at packing time, and ``mkl::_mkl_linear`` only uses the packed weight when
called with that same ``m``; torch passes the row count through, so the engine passes every call's own row
count. That a packed B serves any ``m`` is MKL's behaviour, not its documented contract, so before the first
weight is packed ``mkl_packed_works`` checks it against ``F.linear`` at several row counts in this process and
the engine falls back if it does not hold.

``LLM_LIFECYCLE_CPU_GEMM=mkl|onednn|tiled`` in the environment overrides the choice (for A/B runs, and as a way out
should a library misbehave); ``auto`` (the default) chooses as above. An override that cannot run here (MKL's check
fails, the kernels are not built) falls back to the automatic choice.

On CUDA the projections are ``F.linear`` (cuBLAS), unless ``LLM_LIFECYCLE_GPU_GEMV=triton`` asks for our Triton GEMV
at one activation row (``serving.engine.triton_gemv``; more rows stay on cuBLAS): the candidate for a batch-1 decode
at the copy bandwidth, not yet measured on a GPU, so not the default.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch
import torch.nn.functional as F

from artifacts.common.host import cpuinfo_field
from serving.engine import cpu_kernels

__all__ = ["BACKENDS", "GEMM_ENV", "GPU_GEMV_ENV", "MKL_PACK_ROWS", "choose_backend", "cpu_vendor",
           "mkl_packed_works", "tiled_kernels"]

GEMM_ENV = "LLM_LIFECYCLE_CPU_GEMM"
GPU_GEMV_ENV = "LLM_LIFECYCLE_GPU_GEMV"
BACKENDS = ("mkl", "onednn", "tiled", "triton-gemv", "plain")

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


def tiled_kernels() -> ModuleType | None:
    """The compiled ``cpu_kernels`` when they hold the tiled GEMM (built with AVX2 + FMA), else None."""
    kernels = cpu_kernels.load()
    return kernels if kernels is not None and kernels.tiled_gemm_available() else None


def onednn_supports(w: torch.Tensor) -> bool:
    """oneDNN can pack and run ``w``: a CPU weight, fp32, or bf16 where this CPU has oneDNN's bf16 path."""
    if w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if w.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return w.dtype == torch.float32


def choose_backend(w: torch.Tensor) -> str:
    """One of ``BACKENDS`` for weight ``w``, as the module docstring says (the override first, where it can run)."""
    if w.device.type == "cuda":
        gemv = os.environ.get(GPU_GEMV_ENV, "cublas").strip().lower() or "cublas"
        if gemv not in ("cublas", "triton"):
            raise ValueError(f"{GPU_GEMV_ENV}: expected cublas or triton, got {gemv!r}")
        return "triton-gemv" if gemv == "triton" else "plain"
    choice = os.environ.get(GEMM_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "mkl", "onednn", "tiled"):
        raise ValueError(f"{GEMM_ENV}: expected auto, mkl, onednn or tiled, got {choice!r}")
    fp32_cpu = w.device.type == "cpu" and w.dtype == torch.float32
    if fp32_cpu:
        if choice == "mkl" and mkl_packed_works():
            return "mkl"
        if choice == "tiled" and tiled_kernels() is not None:
            return "tiled"
        if choice != "onednn":  # auto, or an override that cannot run here: the automatic choice
            if cpu_vendor() == "GenuineIntel" and mkl_packed_works():
                return "mkl"
            if tiled_kernels() is not None:
                return "tiled"
    return "onednn" if onednn_supports(w) else "plain"
