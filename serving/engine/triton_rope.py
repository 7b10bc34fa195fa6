"""Rotary embedding of q and k and the KV-cache store, fused into one Triton kernel for the compact forward on a GPU.

Why: on CUDA the torch rotary embedding is about five kernels each for q and k (slice, neg, cat, mul, mul, add)
and the cache store one more, ~11 launches per layer that each cost a few microseconds of GPU time even when
replayed from a CUDA graph, for a few kilobytes of data at decode. This kernel reads the fused QKV projection's
output once and writes rope(q) to ``q_out`` and rope(k) and v straight into the paged caches: one launch.

- **Layout.** One program per token, all heads of it in one tile (q ``[heads, D/2]`` per half, k and v
  ``[kv_heads, D/2]``): a token's row of the QKV output is contiguous, and at decode a single program moves a
  token's few kilobytes in one round trip of independent loads. HF's rotate_half convention: the first half of a
  head pairs with its second half, ``out = x * cos + cat(-x2, x1) * sin``, with the compact forward's tables
  (``cos``/``sin`` ``[max_positions, 1, D]``, both halves stored).
- **Numerics: the torch code's, bit for bit in fp16 and bf16.** Products and the sum are computed in fp32 and
  rounded to the model dtype after each of the three steps, as eager torch does (a product of two 16-bit floats
  is exact in fp32, so rounding it once gives torch's result). Same results as the eager path means a graph
  replay, the torch fallback and HF agree token for token. In fp32 the compiler may fuse a product and the sum
  into an FMA (a last-bit difference). Triton's CPU interpreter truncates fp32 to bf16 instead of rounding, so
  bf16 under the interpreter is off by up to an ulp per step; fp16 and fp32 are exact there.
- **CUDA-graph safety.** The grid is the token count, every size a shape; no host read, no allocation. A row whose
  slot is negative (padding of a graph batch) stores nothing to the caches; its ``q_out`` row is still written
  (the rope of whatever its inputs hold, finite for finite inputs). Positions index the tables unchecked, like
  ``cos[positions]`` in torch: padding rows must hold a valid position (the static inputs hold 0).

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (read when ``@triton.jit`` decorates, i.e. when this module is
imported), which is how CI tests it; ``supported`` says whether it applies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["interpreted", "rope_and_store", "supported"]

MAX_HEAD_DIM = 256
_TILE_PER_WARP = 256  # elements of one half-tile per warp before a launch asks for more warps (32 regs a thread)


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to the model dtype and back: what eager torch stores after each op."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rope_heads(row_ptr, offs_h, offs_j, ok, c1, s1, c2, s2, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
                DTYPE: tl.constexpr):
    """The two halves of rope(x) for the heads ``offs_h`` of a token's row: x1 * cos - x2 * sin and
    x2 * cos + x1 * sin, rounded step by step like torch."""
    ptr = row_ptr + offs_h[:, None] * HEAD_DIM + offs_j[None, :]
    x1 = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    o1 = (_round(x1 * c1[None, :], DTYPE) - _round(x2 * s1[None, :], DTYPE)).to(DTYPE)
    o2 = (_round(x2 * c2[None, :], DTYPE) + _round(x1 * s2[None, :], DTYPE)).to(DTYPE)
    return o1, o2


@triton.jit
def _rope_store_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slots_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                       s_xt, s_tp, s_td, s_ot, s_oh, s_od, s_cb, s_ct, s_ch, s_cd,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, H_PAD: tl.constexpr, KVH_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    """One token: rope(q) into ``q_out``; rope(k) and v into the caches at its slot unless the slot is negative."""
    HALF: tl.constexpr = HEAD_DIM // 2
    DTYPE: tl.constexpr = qkv_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_j = tl.arange(0, HALF_PAD)
    j_ok = offs_j < HALF
    cos_row = cos_ptr + pos * s_tp
    sin_row = sin_ptr + pos * s_tp
    c1 = tl.load(cos_row + offs_j * s_td, mask=j_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + (offs_j + HALF) * s_td, mask=j_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + offs_j * s_td, mask=j_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + (offs_j + HALF) * s_td, mask=j_ok, other=0.0).to(tl.float32)
    row = qkv_ptr + t * s_xt

    offs_h = tl.arange(0, H_PAD)
    q_ok = (offs_h[:, None] < HEADS) & j_ok[None, :]
    q1, q2 = _rope_heads(row, offs_h, offs_j, q_ok, c1, s1, c2, s2, HALF, HEAD_DIM, DTYPE)
    q_dst = q_out_ptr + t * s_ot + offs_h[:, None] * s_oh + offs_j[None, :] * s_od
    tl.store(q_dst, q1.to(q_out_ptr.dtype.element_ty), mask=q_ok)
    tl.store(q_dst + HALF * s_od, q2.to(q_out_ptr.dtype.element_ty), mask=q_ok)

    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs_g = tl.arange(0, KVH_PAD)
    # slot's test is broadcast to a block before the &: triton 3.9's interpreter refuses a mask made of a scalar bool
    kv_ok = (offs_g[:, None] * 0 + slot >= 0) & (offs_g[:, None] < KV_HEADS) & j_ok[None, :]
    k1, k2 = _rope_heads(row + HEADS * HEAD_DIM, offs_g, offs_j, kv_ok, c1, s1, c2, s2, HALF, HEAD_DIM, DTYPE)
    v_src = row + (HEADS + KV_HEADS) * HEAD_DIM + offs_g[:, None] * HEAD_DIM + offs_j[None, :]
    v1 = tl.load(v_src, mask=kv_ok)
    v2 = tl.load(v_src + HALF, mask=kv_ok)
    slot = tl.maximum(slot, 0)  # a padding row's addresses stay in bounds; its stores are masked off
    dst = (slot // BLOCK_SIZE) * s_cb + (slot % BLOCK_SIZE) * s_ct + offs_g[:, None] * s_ch + offs_j[None, :] * s_cd
    tl.store(k_cache_ptr + dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_ok)
    tl.store(k_cache_ptr + dst + HALF * s_cd, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_ok)
    tl.store(v_cache_ptr + dst, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_ok)
    tl.store(v_cache_ptr + dst + HALF * s_cd, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_ok)


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   num_heads: int, kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, q_out: torch.Tensor) -> None:
    """rope(q) into ``q_out [T, num_heads, head_dim]``; rope(k) and v into the caches at ``slot_mapping``.

    ``qkv [T, (num_heads + 2 * kv_heads) * head_dim]``: q, k, v side by side as the fused projection writes them
    (rows may be strided, elements within a row contiguous). ``positions``, ``slot_mapping [T]`` int32 or int64;
    slot = ``block * block_size + offset``, negative for a row that stores nothing. ``cos``, ``sin``
    ``[max_positions, 1, head_dim]`` in qkv's dtype (``CompactLlama.cos``/``.sin``). Caches ``[num_blocks,
    block_size, kv_heads, head_dim]``, K and V of one layout. One launch; shapes decide everything."""
    tokens = qkv.shape[0]
    if tokens == 0:
        return
    if qkv.shape[1] != (num_heads + 2 * kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} (strides {qkv.stride()}) is not [T, ({num_heads} + 2 * "
                         f"{kv_heads}) * {head_dim}] with contiguous rows")
    if cos.stride() != sin.stride() or k_cache.stride() != v_cache.stride():
        raise ValueError("cos and sin, and the K and V caches, must share a layout")
    half_pad = triton.next_power_of_2(head_dim // 2)
    h_pad = triton.next_power_of_2(num_heads)
    warps = min(8, max(1, h_pad * half_pad // _TILE_PER_WARP))
    _rope_store_kernel[(tokens,)](
        qkv, positions, cos, sin, slot_mapping, q_out, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), cos.stride(-1), *q_out.stride(), *k_cache.stride(),
        HEADS=num_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], H_PAD=h_pad,
        KVH_PAD=triton.next_power_of_2(kv_heads), HALF_PAD=half_pad, num_warps=warps)


def interpreted() -> bool:
    """Whether the kernel was decorated for triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_rope_store_kernel, InterpretedFunction)


def supported(t: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel applies to a model whose weights (or KV cache) look like ``t``: on CUDA (or on CPU under
    the interpreter), in fp16, bf16 or fp32, with an even ``head_dim <= MAX_HEAD_DIM``."""
    on_device = t.device.type == "cuda" or (t.device.type == "cpu" and interpreted())
    return (on_device and t.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and 0 < head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0)
