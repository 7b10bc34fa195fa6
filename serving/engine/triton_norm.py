"""The compact forward's row-wise ops on a GPU, one Triton kernel each: residual add + RMSNorm, SiLU-gate multiply.

Why: inside a CUDA graph a decode step's cost is its kernel count (each tiny kernel still takes ~2-3 us of GPU
time), and on CUDA the torch ops behind ``CompactLlama._add_norm`` (``h.add_(delta)`` then ``F.rms_norm``: several
kernels, twice per layer) and the MLP's ``F.silu(g) * u`` (two kernels) are many of the ~24 kernels per layer. These
fuse each into one launch with the contracts of the CPU C++ kernels (``cpu_kernels.add_rms_norm`` / ``silu_mul``), so
the forward can call whichever set fits the device.

Numerics follow the unfused Hugging Face code, roundings included, so a fused model decodes the same tokens:

- ``add_rms_norm``: the residual ``h + delta`` is added in fp32 and rounded to h's dtype on store, and the norm
  reads that rounded value (as ``h.add_(delta)`` then a norm would); then ``LlamaRMSNorm``'s order: variance in
  fp32, ``h * rsqrt(var + eps)`` cast to h's dtype BEFORE the multiply by the weight.
- ``silu_mul``: ``silu(gate)`` in fp32 rounded to the input dtype (what ``F.silu`` returns), then the product with
  ``up`` in fp32, rounded on store (what a bf16/fp16 ``*`` does). The sigmoid is taken from ``exp(-|x|)``, so
  the exponential never overflows.

CUDA-graph safety: grids and block sizes come from shapes only; no host sync, no allocation. On CPU the kernels run
under ``TRITON_INTERPRET=1`` (read when this module is imported), which is how CI tests them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAX_NORM_BLOCK", "SILU_BLOCK", "add_rms_norm", "interpreted", "silu_mul", "supported"]

# A norm row up to this many elements (every Llama up to 70B: hidden <= 8192) is held in registers by one program
# and read once; a longer row is walked in chunks of this size, twice (sum of squares, then the scaled store).
MAX_NORM_BLOCK = 8192
# Columns of the SiLU-gate product per program: 8 bf16 (16 bytes) per thread at 4 warps.
SILU_BLOCK = 1024
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _residual(h_row, d_row, cols, mask, HAS_DELTA: tl.constexpr):
    """One slice of a row of h after ``h += delta`` (stored back, rounded to h's dtype), as fp32."""
    h = tl.load(h_row + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_row + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(h_row.dtype.element_ty)
        tl.store(h_row + cols, h, mask=mask)
    return h.to(tl.float32)


@triton.jit
def _scaled_store(x, rstd, h_row, w_ptr, out_row, cols, mask):
    """``out = (x * rstd).to(h.dtype) * weight``: LlamaRMSNorm's order, the cast before the weight."""
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (x * rstd).to(h_row.dtype.element_ty).to(tl.float32)
    tl.store(out_row + cols, (normed * w).to(out_row.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, out_ptr, n, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """One row: the residual add in place, then its RMSNorm times the weight into ``out``."""
    start = tl.program_id(0).to(tl.int64) * n
    h_row = h_ptr + start
    d_row = d_ptr + start
    out_row = out_ptr + start
    offs = tl.arange(0, BLOCK)
    if CHUNKS == 1:  # the whole row in registers: h is read once
        mask = offs < n
        x = _residual(h_row, d_row, offs, mask, HAS_DELTA)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
        _scaled_store(x, rstd, h_row, w_ptr, out_row, offs, mask)
    else:
        squares = tl.zeros([BLOCK], tl.float32)
        for c in range(CHUNKS):
            cols = c * BLOCK + offs
            x = _residual(h_row, d_row, cols, cols < n, HAS_DELTA)
            squares += x * x
        rstd = tl.rsqrt(tl.sum(squares, 0) / n + eps)
        for c in range(CHUNKS):  # each thread reads back the elements it stored itself
            cols = c * BLOCK + offs
            mask = cols < n
            x = tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32)
            _scaled_store(x, rstd, h_row, w_ptr, out_row, cols, mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    """One (row, column tile): ``out = silu(gate) * up`` from the row's two halves."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate_row = gu_ptr + row * 2 * inter
    g = tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(-tl.abs(g))
    sig = tl.where(g >= 0, 1.0, e) / (1.0 + e)
    act = (g * sig).to(gu_ptr.dtype.element_ty).to(tl.float32)  # F.silu's result, in the input dtype
    tl.store(out_ptr + row * inter + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def interpreted() -> bool:
    """Whether the kernels were decorated for triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_add_rms_norm_kernel, InterpretedFunction)


def supported(t: torch.Tensor) -> bool:
    """Whether these kernels apply to ``t``: on CUDA (or on CPU under the interpreter), fp16, bf16 or fp32,
    contiguous. The forward checks its residual stream once; every tensor of a call must pass."""
    on_device = t.device.type == "cuda" or (t.device.type == "cpu" and interpreted())
    return on_device and t.dtype in _DTYPES and t.is_contiguous()


def _warps(block: int) -> int:
    """Warps for a row block: ~8 elements per thread (16-byte bf16 loads), 1 to 16 warps."""
    return max(1, min(16, block // 256))


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor) -> None:
    """``h += delta`` in place (when ``delta`` is given), then ``out = rms_norm(h) * weight``, in one launch.

    h, delta, out: contiguous ``[T, hidden]`` (out must not alias h); weight ``[hidden]``."""
    rows, n = h.shape
    if (delta is not None and delta.shape != h.shape) or out.shape != h.shape or weight.shape != (n,):
        raise ValueError(f"add_rms_norm: h {tuple(h.shape)}, delta {None if delta is None else tuple(delta.shape)},"
                         f" weight {tuple(weight.shape)}, out {tuple(out.shape)}: want [T, N], [T, N], [N], [T, N]")
    block = min(triton.next_power_of_2(n), MAX_NORM_BLOCK)
    _add_rms_norm_kernel[(rows,)](h, h if delta is None else delta, weight, out, n, float(eps),
                                  HAS_DELTA=delta is not None, BLOCK=block, CHUNKS=triton.cdiv(n, block),
                                  num_warps=_warps(block))


def silu_mul(gu: torch.Tensor, out: torch.Tensor) -> None:
    """``out = silu(gu[:, :I]) * gu[:, I:]`` for a fused gate/up projection ``gu`` ``[T, 2I]``, into ``out``
    ``[T, I]`` (both contiguous), in one launch."""
    rows, inter = out.shape
    if gu.shape != (rows, 2 * inter):
        raise ValueError(f"silu_mul: gu {tuple(gu.shape)}, out {tuple(out.shape)}: want [T, 2I], [T, I]")
    block = min(triton.next_power_of_2(inter), SILU_BLOCK)
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gu, out, inter, BLOCK=block, num_warps=4)
