"""Decode bucketing: groups partition the decodes, and grouped attention equals one padded call."""

import random

import torch
import torch.nn.functional as F

from serving.engine.attention import AttentionMetadata, DecodeGroup, bucket_by_length, paged_attention
from tests.serving.attention_support import decode_case


def test_bucket_by_length_partitions_sorted():
    rng = random.Random(0)
    lens = [rng.randint(1, 600) for _ in range(64)]
    groups = bucket_by_length(lens, 16)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(64))
    assert 1 < len(groups) < 64
    for a, b in zip(groups, groups[1:]):
        assert max(lens[i] for i in a) <= min(lens[i] for i in b)


def test_bucket_by_length_edge_cases():
    assert bucket_by_length([], 16) == []
    assert bucket_by_length([5], 16) == [[0]]
    assert bucket_by_length([3, 3, 3], 16) == [[0, 1, 2]]
    assert len(bucket_by_length([10, 1000], 16, group_cost=0)) == 2
    assert len(bucket_by_length([10, 1000], 16, group_cost=10 ** 9)) == 1


def test_grouped_decode_matches_reference():
    bs, kvh, h, d = 4, 2, 4, 8
    lens = [3, 17, 9, 30, 1]
    k_cache, v_cache, tables, q, k_new, v_new, slots = decode_case(h, kvh, d, lens, bs, num_blocks=64)
    kc, vc, b = [k_cache], [v_cache], len(lens)
    meta = AttentionMetadata(kc, vc, slots, num_decode=b, block_size=bs)
    for rows in bucket_by_length(lens, bs, group_cost=0):
        nblk = -(-max(lens[r] for r in rows) // bs)
        tab = [tables[r][:nblk] + [0] * (nblk - len(tables[r][:nblk])) for r in rows]
        mask = (torch.arange(nblk * bs)[None, :] < torch.tensor([lens[r] for r in rows])[:, None])
        meta.decode_groups.append(DecodeGroup(torch.tensor(rows), torch.tensor(tab).flatten(),
                                              mask.view(len(rows), 1, 1, -1)))
    assert len(meta.decode_groups) > 1
    out = paged_attention(q, k_new, v_new, 0, meta, None)
    for j in range(b):
        slot_ids = torch.tensor([tables[j][p // bs] * bs + p % bs for p in range(lens[j])])
        kk = kc[0].view(-1, kvh, d)[slot_ids].transpose(0, 1).repeat_interleave(h // kvh, 0)
        vv = vc[0].view(-1, kvh, d)[slot_ids].transpose(0, 1).repeat_interleave(h // kvh, 0)
        ref = F.scaled_dot_product_attention(q[j][:, None], kk, vv)[:, 0]
        torch.testing.assert_close(out[j], ref, atol=1e-5, rtol=1e-5)
