"""Weight-only 4-bit linear layers on CUDA: a GPTQ/AWQ snapshot served from its 4-bit codes by Triton kernels.

Why: at batch 1 a decode step reads every weight once, so its time is weight bytes over HBM bandwidth. A 4-bit
layer read as codes moves about a quarter of the bf16 bytes; dequantized to bf16 at load (or unpacked on every
call, as the HF path's library modules do) it moves all of them. ``y = x @ W^T (+ b)`` here reads the codes
once per call and expands them in registers, computing in fp32 what the dequantized layer computes.

Storage (built once at load by ``TritonInt4Linear.from_codes`` from the exact codes, scales and zero points
that ``serving.engine.quantized_checkpoint`` reads):
- ``qweight`` int32 [K'/8, N], K' = K rounded up to a 256-input block. Block b holds inputs 256b .. 256b+255 in
  32 rows of words; nibble j of row i holds input 256b + 32j + i. So one row of a tile is contiguous along N
  (each thread loads 16 bytes, a warp whole 128-byte lines) and nibble j of a tile is the 32 consecutive inputs
  a ``tl.dot`` of depth 32 takes, with no interleaving shuffle.
- ``scales`` and ``zeros`` [G', N] in the checkpoint's scale dtype (fp16 as gptqmodel writes it; zero points
  0..15 are exact in it): ``w[n, k] = (q - zeros[g, n]) * scales[g, n]``, g = k // group_size. The group size
  must be a multiple of 32 (each nibble plane lies in one group); padded groups have scale 0.
Bytes read per weight: 0.5 + 4 / group_size (0.53 at group size 128, fp16 scales and zeros), against 2 for bf16.

Two kernels, chosen by the number of activation rows M (a static shape, so a captured CUDA graph replays one):
- M <= GEMV_MAX_ROWS (decode at batch 1): one program per row and block of BLOCK_N outputs walks all of K,
  GEMV_TILE_WORDS words (U blocks) a step, loads the next step's words before expanding the current ones, and
  accumulates in a [U, 32, BLOCK_N] fp32 register tile reduced once at the end. BLOCK_N is the widest of 64/32/16
  that still gives every SM two programs, so a narrow layer (N = 2048: 128 programs) spreads over the GPU
  without a split-K pass and the extra launches its reduction would cost;
- larger M (batched decode, prefill): a [BLOCK_M, BLOCK_N] tile over K, each nibble plane expanded to the
  activations' dtype and fed to ``tl.dot`` (fp32 activations use IEEE fp32 dots, not TF32).
A code becomes fp32 as ``bitcast(q | 0x4B000000) = 2^23 + q`` minus ``2^23 + z`` (exact), which avoids the
quarter-rate int-to-float conversion: about 6 ALU instructions a weight in the sm_90 SASS of both kernels.
Both take the grid and every block size from shapes only and never synchronise with the host (compile each
shape once, e.g. by a warm-up step, before capturing a graph). On CPU tensors they run in Triton's interpreter
(TRITON_INTERPRET=1 set before triton is first imported), which is how CPU CI tests them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["GEMV_MAX_ROWS", "KBLOCK", "TritonInt4Linear"]

KBLOCK = 256  # inputs per block of the packed layout: 8 nibble planes of 32
PLANE = 32  # inputs per nibble plane (one tl.dot depth); a group size must be a multiple of it
# Up to this many rows the GEMV kernel runs (one program per row and block of outputs); above it the tl.dot kernel.
GEMV_MAX_ROWS = 1
# Words of codes one GEMV program loads per step (8 KB; 16 KB in flight with the prefetch): ~160 registers a
# thread at 4 warps for sm_90, no spills (ptxas through triton.compile, no GPU needed).
GEMV_TILE_WORDS = 2048


@triton.jit
def _int4_gemv(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, N, K, num_kb, stride_xm, stride_ym,
               GROUP: tl.constexpr, BLOCK_N: tl.constexpr, U: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_u = tl.arange(0, U)
    offs_i = tl.arange(0, 32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    x_row = x_ptr + row * stride_xm
    rows = offs_u[:, None] * 32 + offs_i[None, :]  # [U, 32] word rows of a chunk of U blocks
    w_ptrs = w_ptr + rows[:, :, None] * N + offs_n[None, None, :]
    words = tl.load(w_ptrs, mask=(offs_u < num_kb)[:, None, None] & n_ok[None, None, :], other=0)
    acc = tl.zeros((U, 32, BLOCK_N), dtype=tl.float32)
    for kb0 in range(0, num_kb, U):
        kb = kb0 + offs_u
        kb_ok = kb < num_kb
        nxt = tl.load(w_ptrs + (kb0 + U) * 32 * N, mask=(kb + U < num_kb)[:, None, None] & n_ok[None, None, :],
                      other=0)  # the next chunk's words, in flight while this one is expanded
        sz_ok = kb_ok[:, None] & n_ok[None, :]
        for j in tl.static_range(8):
            k = kb[:, None] * 256 + j * 32 + offs_i[None, :]  # [U, 32]
            xv = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            g_off = ((kb * 256 + j * 32) // GROUP)[:, None] * N + offs_n[None, :]  # [U, BLOCK_N]
            s = tl.load(s_ptr + g_off, mask=sz_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g_off, mask=sz_ok, other=0.0).to(tl.float32) + 8388608.0
            # 2^23 + q as fp32 by setting the exponent bits (no int-to-float conversion, a quarter-rate op)
            q = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
            acc += xv[:, :, None] * ((q - z[:, None, :]) * s[:, None, :])  # q - z is exact
        words = nxt
    y = tl.sum(tl.sum(acc, axis=1), axis=0)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["M"])  # the row count changes every step: one compile for all of them
def _int4_gemm(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, num_kb, stride_xm, stride_ym,
               GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
               PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)  # fastest: the programs sharing a block of weights run together (L2 reuse)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_i = tl.arange(0, 32)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, num_kb):
        words = tl.load(w_ptr + (kb * 32 + offs_i)[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0)
        for j in tl.static_range(8):
            k = kb * 256 + j * 32 + offs_i
            xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & (k < K)[None, :],
                         other=0.0)
            g = (kb * 256 + j * 32) // GROUP
            s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32) + 8388608.0
            q = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
            w = (q - z[None, :]) * s[None, :]  # [32, BLOCK_N]
            acc = tl.dot(xt, w.to(xt.dtype), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _block_n(programs_per_col: int, n: int, sms: int, widest: int) -> int:
    """The widest output block (power of two, >= 16) that still gives every SM two programs."""
    block = widest
    while block > 16 and programs_per_col * triton.cdiv(n, block) < 2 * sms:
        block //= 2
    return block


class TritonInt4Linear:
    """``y = x @ w.T + b`` for a weight held as 4-bit codes (see the module docstring); out in x's dtype."""

    __slots__ = ("qweight", "scales", "zeros", "bias", "out_features", "in_features", "group_size")

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
                 in_features: int, group_size: int) -> None:
        self.qweight, self.scales, self.zeros, self.bias = qweight, scales, zeros, bias
        self.out_features = qweight.shape[1]
        self.in_features = in_features
        self.group_size = group_size

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bias: torch.Tensor | None = None) -> TritonInt4Linear:
        """Pack ``codes`` [N, K] (integers 0..15) with per-group ``scales`` and ``zeros`` [N, G] (weight
        ``(codes - zeros) * scales``, group size K / G), on the codes' device. Fused projections are the parts'
        codes, scales and zeros concatenated along N. ValueError when the group size is not a multiple of 32."""
        if codes.dim() != 2 or scales.shape != zeros.shape or scales.shape[0] != codes.shape[0]:
            raise ValueError(f"codes {tuple(codes.shape)}, scales {tuple(scales.shape)} and zeros "
                             f"{tuple(zeros.shape)} do not describe one [N, K] weight")
        n, k = codes.shape
        groups = scales.shape[1]
        if k % groups or (k // groups) % PLANE:
            raise ValueError(f"group size {k / groups:g} ({k} inputs, {groups} groups): must be a multiple of "
                             f"{PLANE} for the Triton int4 kernels")
        group = k // groups
        k_pad = triton.cdiv(k, KBLOCK) * KBLOCK
        c = torch.zeros(k_pad, n, dtype=torch.uint8, device=codes.device)
        c[:k] = codes.T.to(torch.uint8)
        planes = c.view(k_pad // KBLOCK, 8, PLANE, n)  # [block, plane j, row i, n]
        pairs = planes[:, 0::2] | (planes[:, 1::2] << 4)  # byte b of a word: planes 2b (low) and 2b+1 (high)
        qweight = pairs.permute(0, 2, 3, 1).contiguous().view(torch.int32).view(k_pad // 8, n)
        groups_pad = k_pad // group
        dtype = scales.dtype if scales.is_floating_point() else torch.float32
        s = torch.zeros(groups_pad, n, dtype=dtype, device=codes.device)
        z = torch.zeros(groups_pad, n, dtype=dtype, device=codes.device)
        s[:groups] = scales.T.to(dtype)
        z[:groups] = zeros.T.to(dtype)
        return cls(qweight, s, z, None if bias is None else bias.contiguous(), k, group)

    @property
    def nbytes(self) -> int:
        """Bytes the weight takes in memory (codes, scales, zero points; the bias is not counted)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected x [M, {self.in_features}], got {tuple(x.shape)}")
        x = x.contiguous()
        m, n = x.shape[0], self.out_features
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m == 0:
            return y
        sms = _num_sms(x.device)
        num_kb = self.qweight.shape[0] // PLANE
        bias = self.bias if self.bias is not None else y  # any pointer: never read without HAS_BIAS
        weights = (self.qweight, self.scales, self.zeros, bias, y)
        if m <= GEMV_MAX_ROWS:
            block_n = _block_n(m, n, sms, 64)
            _int4_gemv[(triton.cdiv(n, block_n), m)](
                x, *weights, n, self.in_features, num_kb, x.stride(0), y.stride(0), GROUP=self.group_size,
                BLOCK_N=block_n, U=GEMV_TILE_WORDS // (PLANE * block_n), HAS_BIAS=self.bias is not None, num_warps=4)
            return y
        fp32 = x.dtype == torch.float32  # IEEE fp32 dots hold more registers: smaller tiles (no spills on sm_90)
        block_m = min(32 if fp32 else 128, max(16, triton.next_power_of_2(m)))
        block_n = _block_n(triton.cdiv(m, block_m), n, sms, 32 if fp32 else 128 if block_m >= 64 else 64)
        _int4_gemm[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            x, *weights, m, n, self.in_features, num_kb, x.stride(0), y.stride(0), GROUP=self.group_size,
            BLOCK_M=block_m, BLOCK_N=block_n, HAS_BIAS=self.bias is not None,
            PRECISION="ieee" if fp32 else "tf32", num_warps=8 if block_m * block_n >= 8192 else 4,
            num_stages=2 if block_m * block_n >= 8192 else 3)  # 3 stages of a 128x128 tile: 240 KB of shared memory
        return y
