"""A Triton GEMV for dense half-precision weights on CUDA: ``y = x @ W^T (+ b)`` for one row of activations.

Why: at batch 1 a decode step reads every weight once, so its projections should run at the copy bandwidth. On an
H200 (issue 34, run 2) cuBLAS's GEMVs for the 1B Llama shape took 0.73 ms of a 1.11 ms step, about 68% of the
measured copy bandwidth; the rest of the step is small kernels. This kernel is the other candidate the issue names:
one program per block of BLOCK_N output rows walks all of K in BLOCK_K columns, each load a [BLOCK_N, BLOCK_K] tile
contiguous along K (every row of W is one stream, read once), multiplies in fp32 into a register tile and reduces it
once at the end. BLOCK_N is the widest power of two up to 16 that still gives every SM two programs, so a narrow
projection (the K/V heads: N = 512) still spreads over the GPU without a split-K pass and its second launch.

Unmeasured on a GPU so far: ``DenseLinear`` runs it only where ``LLM_LIFECYCLE_GPU_GEMV=triton`` asks
(``serving.engine.linear_backend``), and the device check times both (``benchmarks/gpu_serving.py``, section
``gemv``). The grid and the block sizes come from shapes only and it never synchronises with the host, so a CUDA
graph captures it. On CPU tensors it runs in Triton's interpreter (TRITON_INTERPRET=1 set before triton is first
imported), which is how CPU CI tests it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.engine.triton_int4 import _num_sms

__all__ = ["GEMV_ENV", "dense_gemv", "gemv_block_n"]

GEMV_ENV = "LLM_LIFECYCLE_GPU_GEMV"
BLOCK_K = 512  # columns a program loads per step; sm_90 (ptxas): 48 / 72 / 128 registers a thread at BLOCK_N
# 4 / 8 / 16 and 4 warps, no spills, 16-byte loads (tests/serving/test_triton_sm90.py compiles every 1B launch)


@triton.jit
def _dense_gemv(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn, stride_xm, stride_ym,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        x = tl.load(x_ptr + row * stride_xm + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv_block_n(n: int, rows: int, sms: int) -> int:
    """Output rows per program: the widest power of two up to 16 that still gives every SM two programs."""
    block = 16
    while block > 1 and rows * triton.cdiv(n, block) < 2 * sms:
        block //= 2
    return block


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` [M, K] (M small: one program column per row) and ``weight`` [N, K] with
    contiguous rows; out [M, N] in x's dtype, accumulated in fp32."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("dense_gemv: the weight's rows must be contiguous")
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_n = gemv_block_n(n, m, _num_sms(x.device))
    _dense_gemv[(triton.cdiv(n, block_n), m)](
        x, weight, bias if bias is not None else y, y, n, k, weight.stride(0), x.stride(0), y.stride(0),
        BLOCK_N=block_n, BLOCK_K=BLOCK_K, HAS_BIAS=bias is not None, num_warps=4)
    return y
