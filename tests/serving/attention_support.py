"""A random decode step over a paged KV cache, for the attention tests (test_attention_buckets,
test_cpu_kernels). Not a test module."""

from __future__ import annotations

import torch


def decode_case(heads: int, kv_heads: int, d: int, lens: list[int], bs: int = 16, num_blocks: int | None = None,
                seed: int = 0):
    """Caches ``[num_blocks, bs, kv_heads, d]`` (by default the blocks the sequences need, plus 3), each
    sequence's block table (a random permutation of the blocks, dealt out in order), ``q [B, heads, d]``, the
    step's new K/V ``[B, kv_heads, d]`` and the slot of each sequence's last token."""
    torch.manual_seed(seed)
    nb = num_blocks if num_blocks is not None else sum(-(-n // bs) for n in lens) + 3
    kc, vc = torch.randn(nb, bs, kv_heads, d), torch.randn(nb, bs, kv_heads, d)
    perm = torch.randperm(nb).tolist()
    tables, i = [], 0
    for n in lens:
        k = -(-n // bs)
        tables.append(perm[i:i + k])
        i += k
    b = len(lens)
    q, k_new, v_new = torch.randn(b, heads, d), torch.randn(b, kv_heads, d), torch.randn(b, kv_heads, d)
    slots = torch.tensor([tables[j][(lens[j] - 1) // bs] * bs + (lens[j] - 1) % bs for j in range(b)])
    return kc, vc, tables, q, k_new, v_new, slots
