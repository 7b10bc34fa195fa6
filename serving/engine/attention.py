"""Paged attention plugged into Hugging Face models through transformers' attention interface.

The model sees one flattened "batch" of shape [1, T]: the decode tokens of every decoding sequence
first, then the prefill chunks, with ``position_ids`` giving each token's position in its own
sequence. For every layer this function
1. scatters the new K/V into the preallocated cache with one ``index_copy_`` over the slot mapping;
2. runs all decode queries in one SDPA call over each sequence's K/V gathered into a padded tensor
   (whole-block ``index_select`` by block table, a key-padding mask), grouping query heads per KV head for GQA;
3. runs each prefill chunk with SDPA: causal over its own K/V when nothing is cached before it,
   else over its gathered context with an offset-causal mask.
All index tensors are built once per step (``AttentionMetadata``) and shared by every layer.
"""

from __future__ import annotations

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
class AttentionMetadata:
    k_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T]
    num_decode: int = 0
    block_size: int = 16
    decode_blocks: torch.Tensor | None = None  # [B * nblk] block ids, row-major (padded with block 0)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, nblk * block_size] bool
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: AttentionMetadata,
                    scaling: float | None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (after rotary) → attention output [T, H, D]; writes k/v to the cache."""
    kc, vc = meta.k_caches[layer], meta.v_caches[layer]
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    kc.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)  # slot = block * block_size + offset
    vc.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    # whole-block gathers: one contiguous row (block_size * KVH * D values) per block id
    kb = kc.view(-1, meta.block_size * kv_heads * head_dim)
    vb = vc.view(-1, meta.block_size * kv_heads * head_dim)
    nd = meta.num_decode
    if nd:
        kd = kb.index_select(0, meta.decode_blocks).view(nd, -1, kv_heads, head_dim).transpose(1, 2)
        vd = vb.index_select(0, meta.decode_blocks).view(nd, -1, kv_heads, head_dim).transpose(1, 2)
        qd = q[:nd].reshape(nd, kv_heads, group, head_dim)  # query heads grouped under their KV head
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scaling)
        out[:nd] = od.reshape(nd, num_heads, head_dim)

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
