"""Paged attention plugged into Hugging Face models through transformers' attention interface.

The model sees one flattened "batch" of shape [1, T]: the decode tokens of every decoding sequence
first, then the prefill chunks, with ``position_ids`` giving each token's position in its own
sequence. For every layer this function
1. scatters the new K/V into the preallocated cache with one ``index_copy_`` over the slot mapping;
2. runs the decode queries: with ``cpu_kernels.paged_decode`` (C++, fp32 CPU) in one call that reads
   every sequence's K/V straight from its blocks, with no padded copy; otherwise in a few SDPA calls, one
   per group of decodes with similar context length (``bucket_by_length``), each over its sequences' K/V
   gathered into a padded tensor (whole-block ``index_select`` by block table, a key-padding mask),
   grouping query heads per KV head for GQA. One padded call over all decodes would pad every sequence
   to the longest (about a third padding at the benchmark's mix of lengths) and was measured slower than
   the groups (decode steps of ~47 sequences with contexts around 210 tokens: 54.5 ms padded, 38.8 ms in
   groups);
3. runs the prefill chunks (and speculative verify chunks): with ``cpu_kernels.paged_prefill`` (C++, fp32 CPU,
   block size 16) in one call that reads every chunk's context straight from its blocks, causally; otherwise
   each chunk with SDPA, causal over its own K/V when nothing is cached before it, else over its gathered
   context with an offset-causal mask.
All index tensors are built once per step (``AttentionMetadata``) and shared by every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "llm_lifecycle_paged"


@dataclass
class PrefillChunk:
    start: int  # first row in the flattened batch
    end: int
    ctx_blocks: torch.Tensor | None = None  # [nblk] block ids of the whole context, None if fresh
    mask: torch.Tensor | None = None  # [n, nblk * block_size] bool, True = attend


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [n] rows of the flattened batch (all < num_decode)
    blocks: torch.Tensor  # [n * nblk] block ids, row-major (padded with block 0)
    mask: torch.Tensor  # [n, 1, 1, nblk * block_size] bool, True = attend


# cost of one extra decode group, in gathered tokens (per-call overhead of gather + SDPA; see bucket_by_length)
GROUP_COST_TOKENS = 256


def bucket_by_length(lens: list[int], block_size: int,
                     group_cost: int = GROUP_COST_TOKENS) -> list[list[int]]:
    """Partition indices of ``lens`` into groups of similar length (each sorted by length), minimising
    sum(group size * padded length of its longest member) + group_cost * number of groups (exact DP over
    the length-sorted order, O(n^2) for n decodes)."""
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    padded = [-(-lens[i] // block_size) * block_size for i in order]
    n = len(order)
    best = [0] + [float("inf")] * n
    prev = [0] * (n + 1)
    for e in range(1, n + 1):
        width = padded[e - 1]
        for s in range(e):
            c = best[s] + (e - s) * width + group_cost
            if c < best[e]:
                best[e], prev[e] = c, s
    groups: list[list[int]] = []
    e = n
    while e > 0:
        groups.append(order[prev[e]:e])
        e = prev[e]
    groups.reverse()
    return groups


@dataclass
class AttentionMetadata:
    k_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T]
    num_decode: int = 0
    block_size: int = 16
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # kernel path (instead of decode_groups): [num_decode, max_blocks] block ids (padded with 0), [num_decode]
    decode_block_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    decode_kernel: Callable[..., None] | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # kernel path (instead of prefills): every chunk in one call, its rows after the decodes, straight from the
    # cache: [P, max_blocks] block ids, [P + 1] row offsets from the first prefill row, [P] first positions
    prefill_kernel: Callable[..., None] | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_row_starts: torch.Tensor | None = None
    prefill_first_pos: torch.Tensor | None = None
    # writes the step's K/V into the cache (``store_kv(k, v, k_cache, v_cache, slot_mapping)``, skipping slots < 0,
    # the padding rows of a CUDA graph); None: ``index_copy_`` over the slot mapping
    store_kv: Callable[..., None] | None = None
    # the forward already wrote this step's K/V into the cache (``triton_rope.rope_and_store``): skip the store
    kv_stored: bool = False


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: AttentionMetadata,
                    scaling: float | None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (after rotary) → attention output [T, H, D]; writes k/v to the cache."""
    kc, vc = meta.k_caches[layer], meta.v_caches[layer]
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    if meta.kv_stored:
        pass
    elif meta.store_kv is not None:
        meta.store_kv(k, v, kc, vc, meta.slot_mapping)
    else:
        kc.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)  # slot = block * block_size + offset
        vc.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    group = num_heads // kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # whole-block gathers: one contiguous row (block_size * KVH * D values) per block id
    kb = kc.view(-1, meta.block_size * kv_heads * head_dim)
    vb = vc.view(-1, meta.block_size * kv_heads * head_dim)
    if meta.decode_kernel is not None and meta.num_decode:
        nd = meta.num_decode
        meta.decode_kernel(q[:nd].contiguous(), kc, vc, meta.decode_block_tables, meta.decode_lens,
                           head_dim ** -0.5 if scaling is None else scaling, out[:nd])
    for g in meta.decode_groups:
        nd = g.rows.shape[0]
        kd = kb.index_select(0, g.blocks).view(nd, -1, kv_heads, head_dim).transpose(1, 2)
        vd = vb.index_select(0, g.blocks).view(nd, -1, kv_heads, head_dim).transpose(1, 2)
        qd = q.index_select(0, g.rows).view(nd, kv_heads, group, head_dim)  # query heads under their KV head
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scaling)
        out.index_copy_(0, g.rows, od.reshape(nd, num_heads, head_dim))

    if meta.prefill_kernel is not None:
        nd = meta.num_decode
        meta.prefill_kernel(q[nd:].contiguous(), kc, vc, meta.prefill_block_tables, meta.prefill_row_starts,
                            meta.prefill_first_pos, head_dim ** -0.5 if scaling is None else scaling, out[nd:])
    gqa = group > 1
    for p in meta.prefills:
        qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.ctx_blocks is None:
            kp = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
            vp = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            kp = kb.index_select(0, p.ctx_blocks).view(-1, kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
            vp = vb.index_select(0, p.ctx_blocks).view(-1, kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scaling, enable_gqa=gqa)
        out[p.start:p.end] = op[0].transpose(0, 1)
    return out


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            paged_metadata: AttentionMetadata | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """The transformers attention-interface entry: shapes [1, heads, T, head_dim] in, [1, T, H, D] out."""
    if paged_metadata is None:
        raise RuntimeError("paged attention called without paged_metadata (use the engine's ModelRunner)")
    out = paged_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                          module.layer_idx, paged_metadata, scaling)
    return out.unsqueeze(0), None


def register() -> str:
    """Register the paged attention (and a no-op mask builder) with transformers; idempotent."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
