"""Paged attention in Triton for the GPU: decode (split-KV), prefill and chunked prefill, and the KV store.

They fill the same hooks as ``cpu_kernels`` (``AttentionMetadata.decode_kernel`` / ``prefill_kernel``) and read the
same cache, ``[num_blocks, block_size, kv_heads, head_dim]`` per layer (K and V caches of one shape and layout:
the kernels take K's strides for both), straight through the block tables: no gathered copy of the context, no
mask tensor, so K/V cross HBM once per step instead of three times.

Why this shape of kernel:

- **GQA through ``tl.dot``.** A program owns one KV head and all G query heads under it, so every K/V tile it loads
  serves G query rows at once on the tensor cores. Decode pads the G rows up to 16 (the smallest ``tl.dot``);
  prefill packs (query token, query head) pairs into the rows of its tile, ``BLOCK_M // G`` tokens of G heads.
- **Tokens, not blocks, in a tile.** Each K/V tile is ``BLOCK_N`` consecutive context positions; the block of
  each position is read from the block table (``table[pos // block_size]``), so a tile may span several cache
  blocks and the tile size is a tuning choice independent of the cache's block size.
- **Split-KV for decode (flash-decoding).** At batch 1 a decode step has only ``kv_heads`` (8 for a Llama-3 1B)
  units of work: 8 of an H100's 132 SMs. Each sequence's context is therefore cut into ``num_splits`` ranges,
  every (sequence, KV head, split) program writes a partial (accumulator, running max, running sum) and a
  second small kernel combines them. A program derives its range from its own ``seq_len``, so the splits of a
  short sequence share its few tiles and the ones left over write an empty partial the combine ignores. At
  large batch the (sequence, KV head) programs alone fill the GPU, the split count drops to one and the first
  kernel writes the output itself (no scratch, no second launch).
- **CUDA-graph safety.** Launch grids, the split count and every allocation depend only on shapes (batch,
  block-table width, heads, head_dim) and the device's SM count, never on tensor values: no ``.item()``, no host
  read of a length. Padding rows of a graph batch (``seq_len == 0``; slot ``-1`` in the store) read nothing out
  of bounds and write zeros (or nothing, for the store). Decode scratch can be preallocated per graph bucket
  (``DecodeScratch``) and passed in so a replay reuses it.
- **Prefill without host syncs.** The grid has ``T // BLOCK_Q + P`` query tiles (an upper bound, shapes only):
  chunk p's tiles are numbered from ``row_starts[p] // BLOCK_Q + p``, a program finds its chunk by a binary
  search over ``row_starts`` on the device, and tiles past a chunk's end do nothing. No value of the chunk
  count is compiled in, so a new number of chunks never recompiles. The same kernel serves fresh prompts,
  chunks continuing a cached context and speculative verify chunks (a few rows, long context), causal within
  the chunk.
- **Precision.** Softmax and accumulation in fp32 (``exp2`` with the scale folded into log2 units), cast on
  store. fp32 inputs use IEEE ``tl.dot`` (not TF32), so the fp32 path matches the torch reference to ~1e-5.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (triton reads it when ``@triton.jit`` decorates, i.e. when
this module is imported), which is how CI tests them; ``supported`` says whether they apply to a cache.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["DecodeScratch", "decode_splits", "interpreted", "paged_decode", "paged_prefill", "store_kv", "supported"]

# _SPECIALIZATION: triton compiles a kernel again for every new pattern of its integer arguments (equal to 1,
# divisible by 16) and pointer alignments. Arguments that change from step to step (the number of chunks, of
# splits) are therefore not specialised, and the engine keeps its index tensors 64-byte aligned
# (``step_inputs``): otherwise a server compiles again mid-traffic (about half a second a time, seen as the
# first token of a new batch shape on the first GPU run).

# Tile sizes: at bf16 with head_dim 128 these compile for sm_90 without register spills (64-position K/V tiles
# spill: every gathered position keeps its own address in registers)
DECODE_BLOCK_N = 32  # context positions per K/V tile in decode
PREFILL_BLOCK_M = 64  # (query token, query head) rows per prefill tile
PREFILL_BLOCK_N = 32  # context positions per K/V tile in prefill
MAX_SPLITS = 64  # decode splits per (sequence, KV head)
PROGRAMS_PER_SM = 2  # decode aims at this many programs per SM before it stops splitting
MAX_HEAD_DIM = 256
_DEFAULT_SMS = 132  # an H100's SM count: what the split choice assumes off CUDA (the interpreter)


@triton.jit(do_not_specialize=["num_splits"])  # see _SPECIALIZATION
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, acc_ptr, max_ptr, sum_ptr,
                         qk_scale, num_splits,
                         s_qb, s_qh, s_qd, s_cb, s_ct, s_ch, s_cd, s_tb, s_ob, s_oh, s_od,
                         G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                         SINGLE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One (sequence, KV head, split): the G query heads of the KV head against the split's context tiles."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    heads = G * tl.num_programs(1)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_g < G
    d_ok = offs_d < HEAD_DIM
    head = kvh * G + offs_g

    q = tl.load(q_ptr + b * s_qb + head[:, None] * s_qh + offs_d[None, :] * s_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    tile0 = split * per_split
    tile1 = tl.minimum(tile0 + per_split, num_tiles)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table = tables_ptr + b.to(tl.int64) * s_tb
    for tile in range(tile0, tile1):
        pos = tile * BLOCK_N + offs_n
        pos_ok = pos < seq_len
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        base = block * s_cb + (pos % BLOCK_SIZE) * s_ct + kvh * s_ch
        k = tl.load(k_ptr + base[None, :] + offs_d[:, None] * s_cd, mask=d_ok[:, None] & pos_ok[None, :], other=0.0)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: a tile in range has at least one position
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + base[:, None] + offs_d[None, :] * s_cd, mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SINGLE:
        denom = tl.where(l_i > 0, l_i, 1.0)  # seq_len 0 (a padding row): zeros
        o = acc / denom[:, None]
        tl.store(out_ptr + b * s_ob + head[:, None] * s_oh + offs_d[None, :] * s_od, o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = (b * heads + head) * num_splits + split  # scratch [B, H, S] (and [B, H, S, D] for acc)
        tl.store(max_ptr + part, m_i, mask=row_ok)
        tl.store(sum_ptr + part, l_i, mask=row_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_combine_kernel(acc_ptr, max_ptr, sum_ptr, out_ptr, num_splits, s_ob, s_oh, s_od,
                           HEAD_DIM: tl.constexpr, S_PAD: tl.constexpr, D_PAD: tl.constexpr):
    """One (sequence, query head): rescale the splits' partials to their common max and normalise."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    part = (b * tl.num_programs(1) + h) * num_splits + offs_s
    m = tl.load(max_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(sum_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # every split empty (seq_len 0): weights exp2(-inf) = 0
    w = tl.exp2(m - m_all)
    total = tl.sum(l_s * w, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_d * s_od, o.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit(do_not_specialize=["num_chunks"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, row_starts_ptr, first_pos_ptr, out_ptr, qk_scale, num_chunks,
                    s_qt, s_qh, s_qd, s_cb, s_ct, s_ch, s_cd, s_tb, s_ot, s_oh, s_od,
                    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    G_PAD: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One (query tile, KV head): BLOCK_M // G_PAD query tokens of one chunk times its G query heads, causal over
    the chunk's context read through its block table."""
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    tile = tl.program_id(0)
    kvh = tl.program_id(1)

    # which chunk: the last one whose first tile, row_starts[p] // BLOCK_Q + p, is at or before this tile
    # (a binary search; the first tiles rise strictly with p, and chunk 0's is tile 0)
    chunk = tile * 0
    hi = num_chunks - 1
    while chunk < hi:
        mid = (chunk + hi + 1) // 2
        at_or_before = tl.load(row_starts_ptr + mid).to(tl.int32) // BLOCK_Q + mid <= tile
        chunk = tl.where(at_or_before, mid, chunk)
        hi = tl.where(at_or_before, hi, mid - 1)
    row0 = tl.load(row_starts_ptr + chunk).to(tl.int32)
    rows = tl.load(row_starts_ptr + chunk + 1).to(tl.int32) - row0
    pos0 = tl.load(first_pos_ptr + chunk).to(tl.int32)
    local0 = (tile - (row0 // BLOCK_Q + chunk)) * BLOCK_Q  # this tile's first row within the chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    local = local0 + offs_m // G_PAD
    g = offs_m % G_PAD
    row_ok = (local < rows) & (g < G)
    d_ok = offs_d < HEAD_DIM
    token = (row0 + local).to(tl.int64)
    head = kvh * G + g
    q = tl.load(q_ptr + token[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :] * s_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = pos0 + local
    # context this tile needs: up to its last row's position (none for a tile past the chunk's end)
    ctx = tl.where(local0 < rows, pos0 + tl.minimum(local0 + BLOCK_Q, rows), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = tables_ptr + chunk.to(tl.int64) * s_tb
    for start in range(0, ctx, BLOCK_N):
        pos = start + offs_n
        pos_ok = pos < ctx
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        base = block * s_cb + (pos % BLOCK_SIZE) * s_ct + kvh * s_ch
        k = tl.load(k_ptr + base[None, :] + offs_d[:, None] * s_cd, mask=d_ok[:, None] & pos_ok[None, :], other=0.0)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite from the first tile on: position 0 is visible to every row
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + base[:, None] + offs_d[None, :] * s_cd, mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :] * s_od,
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                     s_kt, s_kh, s_kd, s_vt, s_vh, s_vd, s_cb, s_ct, s_ch, s_cd,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     H_PAD: tl.constexpr, D_PAD: tl.constexpr):
    """One token: its K and V rows (all KV heads) into the cache slot; slot < 0 (a padding row) writes nothing."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    # slot's test is broadcast to a block before the &: triton 3.9's interpreter refuses a mask made of a scalar bool
    ok = (offs_h[:, None] * 0 + slot >= 0) & (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    slot = tl.maximum(slot, 0)
    dst = (slot // BLOCK_SIZE) * s_cb + (slot % BLOCK_SIZE) * s_ct + offs_h[:, None] * s_ch + offs_d[None, :] * s_cd
    k = tl.load(k_ptr + t * s_kt + offs_h[:, None] * s_kh + offs_d[None, :] * s_kd, mask=ok)
    v = tl.load(v_ptr + t * s_vt + offs_h[:, None] * s_vh + offs_d[None, :] * s_vd, mask=ok)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------- launchers
_LOG2E = 1.4426950408889634


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


def _dot_precision(t: torch.Tensor) -> str:
    """IEEE products for fp32 (TF32 would cost fp32 callers three decimal digits); the default otherwise."""
    return "ieee" if t.dtype == torch.float32 else "tf32"


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS


def decode_splits(batch: int, kv_heads: int, max_blocks: int, block_size: int, device: torch.device) -> int:
    """Splits per (sequence, KV head) for a decode of these shapes: enough programs to fill the SMs
    (``PROGRAMS_PER_SM`` each), no more than the widest context has tiles. Shapes only, so a graph bucket keeps
    one value."""
    tiles = triton.cdiv(max_blocks * block_size, DECODE_BLOCK_N)
    wanted = triton.cdiv(PROGRAMS_PER_SM * _sm_count(torch.device(device)), max(1, batch * kv_heads))
    return max(1, min(wanted, tiles, MAX_SPLITS))


@dataclass
class DecodeScratch:
    """Per-split partials of a decode: ``acc [B, H, S, D]``, running ``max`` and ``sum`` ``[B, H, S]``, fp32,
    contiguous. Allocate once per CUDA-graph bucket (``for_shape``) and pass to every ``paged_decode`` of that
    bucket."""

    acc: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor

    @classmethod
    def for_shape(cls, batch: int, heads: int, head_dim: int, num_splits: int,
                  device: torch.device | str) -> DecodeScratch:
        kw = {"dtype": torch.float32, "device": device}
        return cls(torch.empty(batch, heads, num_splits, head_dim, **kw), torch.empty(batch, heads, num_splits, **kw),
                   torch.empty(batch, heads, num_splits, **kw))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor, *, num_splits: int | None = None,
                 scratch: DecodeScratch | None = None) -> None:
    """Decode attention, one query token per sequence, into ``out``.

    q, out ``[B, H, D]``; caches ``[num_blocks, block_size, KVH, D]``; ``block_tables [B, max_blocks]`` (int32 or
    int64); ``seq_lens [B]``: context length including the current token (already stored); 0 for a padding row,
    whose output is zeros. ``num_splits`` defaults to ``decode_splits``; ``scratch`` (shapes ``[B, H, num_splits,
    D]`` etc.) to a fresh allocation when more than one split is used."""
    batch, heads, head_dim = q.shape
    if batch == 0:
        return
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    g = heads // kv_heads
    splits = num_splits or decode_splits(batch, kv_heads, block_tables.shape[1], block_size, q.device)
    if splits > 1 and scratch is None:
        scratch = DecodeScratch.for_shape(batch, heads, head_dim, splits, q.device)
    elif splits > 1 and scratch.acc.shape != (batch, heads, splits, head_dim):
        raise ValueError(f"decode scratch {tuple(scratch.acc.shape)} does not fit {splits} splits of q "
                         f"{tuple(q.shape)}")
    parts = (scratch.acc, scratch.max, scratch.sum) if splits > 1 else (out, out, out)  # unused when single
    d_pad = _pow2(head_dim, 16)
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, *parts, scale * _LOG2E, splits,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride(),
        G=g, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, G_PAD=_pow2(g, 16), D_PAD=d_pad, BLOCK_N=DECODE_BLOCK_N,
        SINGLE=splits == 1, DOT_PRECISION=_dot_precision(q), num_warps=4)
    if splits > 1:
        _decode_combine_kernel[(batch, heads)](
            scratch.acc, scratch.max, scratch.sum, out, splits, *out.stride(),
            HEAD_DIM=head_dim, S_PAD=_pow2(splits), D_PAD=d_pad, num_warps=4)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  row_starts: torch.Tensor, first_pos: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Causal attention for P chunks flattened into ``q, out [T, H, D]``, into ``out``.

    Chunk p owns rows ``row_starts[p]:row_starts[p + 1]`` (``row_starts [P + 1]``, ``row_starts[P] == T``) at
    positions ``first_pos[p]`` onwards; its whole context (cached tokens and the chunk itself, already stored)
    is in the blocks of ``block_tables[p]``. A row attends to its context up to its own position."""
    tokens, heads, head_dim = q.shape
    chunks = block_tables.shape[0]
    if tokens == 0 or chunks == 0:
        return
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    g = heads // kv_heads
    g_pad = _pow2(g)
    block_m = max(PREFILL_BLOCK_M, g_pad)
    grid = (tokens // (block_m // g_pad) + chunks, kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, row_starts, first_pos, out, scale * _LOG2E, chunks,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride(),
        G=g, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, G_PAD=g_pad, D_PAD=_pow2(head_dim, 16),
        BLOCK_M=block_m, BLOCK_N=PREFILL_BLOCK_N, DOT_PRECISION=_dot_precision(q), num_warps=4)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k, v [T, KVH, D]`` into the caches at ``slot_mapping [T]`` (``block * block_size + offset``);
    rows whose slot is negative (padding rows of a graph batch) are skipped. One launch for K and V."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping, *k.stride(), *v.stride(), *k_cache.stride(),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], H_PAD=_pow2(kv_heads),
        D_PAD=_pow2(head_dim), num_warps=1)


def interpreted() -> bool:
    """Whether the kernels were decorated for triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_prefill_kernel, InterpretedFunction)


def supported(k_cache: torch.Tensor, head_dim: int, block_size: int) -> bool:
    """Whether these kernels apply to a cache like ``k_cache``: on CUDA (or on CPU under the interpreter), in
    fp16, bf16 or fp32, with a power-of-two block size and ``head_dim <= MAX_HEAD_DIM``."""
    on_device = k_cache.device.type == "cuda" or (k_cache.device.type == "cpu" and interpreted())
    return (on_device and k_cache.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and 0 < head_dim <= MAX_HEAD_DIM and block_size > 0 and block_size & (block_size - 1) == 0)
