"""Tensor-parallel ownership: rules per Llama-family name, rank ranges, and refusals."""

from __future__ import annotations

import pytest

from artifacts.shard_plan import TPDegreeError, plan_shards, split_rule


@pytest.mark.parametrize("name, expected", [
    ("model.layers.0.self_attn.q_proj.weight", ("column", 0)),
    ("model.layers.0.self_attn.k_proj.bias", ("column", 0)),
    ("model.layers.3.mlp.up_proj.qweight", ("column", 1)),
    ("model.layers.3.mlp.gate_proj.g_idx", ("replicate", None)),
    ("model.layers.0.self_attn.o_proj.weight", ("row", 1)),
    ("model.layers.0.self_attn.o_proj.bias", ("replicate", None)),
    ("model.layers.1.mlp.down_proj.scales", ("row", 0)),
    ("model.layers.1.mlp.down_proj.g_idx", ("row", 0)),
    ("model.embed_tokens.weight", ("vocab", 0)),
    ("lm_head.weight", ("vocab", 0)),
    ("model.layers.0.input_layernorm.weight", ("replicate", None)),
    ("model.norm.weight", ("replicate", None)),
])
def test_split_rules(name, expected):
    ndim = 1 if "norm" in name or "bias" in name or "g_idx" in name else 2
    assert split_rule(name, ndim) == expected


def _shapes(hidden=64, heads=4, kv=2, inter=128, vocab=300):
    head_dim = hidden // heads
    return {
        "model.embed_tokens.weight": [vocab, hidden],
        "model.layers.0.self_attn.q_proj.weight": [heads * head_dim, hidden],
        "model.layers.0.self_attn.k_proj.weight": [kv * head_dim, hidden],
        "model.layers.0.self_attn.o_proj.weight": [hidden, heads * head_dim],
        "model.layers.0.mlp.down_proj.weight": [hidden, inter],
        "model.layers.0.input_layernorm.weight": [hidden],
        "lm_head.weight": [vocab, hidden],
    }


@pytest.mark.parametrize("degree", [1, 2])
def test_ranks_partition_each_split_dim(degree):
    shapes = _shapes()
    plan = plan_shards(shapes, degree, num_heads=4, num_kv_heads=2)
    for name, split in plan.tensors.items():
        if split.kind == "replicate":
            assert split.ranges == []
            continue
        size = shapes[name][split.dim]
        assert split.ranges[0][0] == 0 and split.ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(split.ranges, split.ranges[1:]))
        assert len({stop - start for start, stop in split.ranges}) == 1
    assert plan.tensors["model.layers.0.input_layernorm.weight"].kind == "replicate"
    if degree == 2:  # the last rank owns the second half of down_proj's input features
        down = plan.tensors["model.layers.0.mlp.down_proj.weight"]
        assert (down.dim, down.ranges[1]) == (1, [64, 128])
    assert len(plan.kv_heads) == degree


def test_undividable_vocab_is_replicated():
    plan = plan_shards(_shapes(vocab=301), 2, num_heads=4, num_kv_heads=2)
    assert plan.tensors["model.embed_tokens.weight"].kind == "replicate"
    assert plan.tensors["lm_head.weight"].kind == "replicate"


def test_dimension_that_does_not_divide_names_tensor_and_dims():
    # Heads (4) and KV heads (2) take degree 2; down_proj's 129 input features do not.
    with pytest.raises(TPDegreeError, match=r"tp degree 2: tensor model\.layers\.0\.mlp\.down_proj\.weight "
                                            r"shape \[64, 129\] dim 1 = 129 is not divisible by 2") as info:
        plan_shards(_shapes(inter=129), 2, num_heads=4, num_kv_heads=2)
    assert info.value.tensor == "model.layers.0.mlp.down_proj.weight"


def test_kv_heads_are_replicated_when_the_degree_exceeds_them():
    """vLLM's rule: tp > KV heads and a multiple of them -> each KV head on tp / kv consecutive ranks."""
    # 12 heads of 8 dims, 2 KV heads (k_proj 16 rows): degree 4 puts KV head 0 on ranks 0-1, head 1 on 2-3.
    shapes = _shapes(hidden=96, heads=12, kv=2, inter=128, vocab=300)
    plan = plan_shards(shapes, 4, num_heads=12, num_kv_heads=2)
    assert plan.kv_heads == [[0], [0], [1], [1]]
    k_proj = plan.tensors["model.layers.0.self_attn.k_proj.weight"]
    assert (k_proj.kind, k_proj.dim, k_proj.ranges) == ("column", 0, [[0, 8], [0, 8], [8, 16], [8, 16]])
    assert plan.tensors["model.layers.0.self_attn.q_proj.weight"].ranges == [[0, 24], [24, 48], [48, 72], [72, 96]]
    assert plan_shards(shapes, 2, num_heads=12, num_kv_heads=2).kv_heads == [[0], [1]]
    assert plan_shards(shapes, 1, num_heads=12, num_kv_heads=2).kv_heads == [[0, 1]]


def test_kv_heads_are_split_by_whole_heads_when_the_degree_divides_them():
    shapes = _shapes(hidden=64, heads=8, kv=4)  # 4 KV heads of 8 dims
    plan = plan_shards(shapes, 2, num_heads=8, num_kv_heads=4)
    assert plan.kv_heads == [[0, 1], [2, 3]]
    assert plan.tensors["model.layers.0.self_attn.k_proj.weight"].ranges == [[0, 16], [16, 32]]


def test_packed_kv_projections_are_sliced_by_whole_heads():
    # GPTQ k_proj (2 KV heads of 32 dims, 4-bit, group 32, K = 128): qweight [16, 64], qzeros [4, 8], scales [4, 64]
    shapes = {"model.layers.0.self_attn.k_proj.qweight": [16, 64], "model.layers.0.self_attn.k_proj.qzeros": [4, 8],
              "model.layers.0.self_attn.k_proj.scales": [4, 64], "model.layers.0.self_attn.k_proj.g_idx": [128]}
    plan = plan_shards(shapes, 4, num_heads=4, num_kv_heads=2)
    assert plan.tensors["model.layers.0.self_attn.k_proj.qweight"].ranges == [[0, 32], [0, 32], [32, 64], [32, 64]]
    assert plan.tensors["model.layers.0.self_attn.k_proj.qzeros"].ranges == [[0, 4], [0, 4], [4, 8], [4, 8]]
    assert plan.tensors["model.layers.0.self_attn.k_proj.g_idx"].kind == "replicate"
    with pytest.raises(TPDegreeError, match=r"k_proj\.qzeros shape \[4, 3\] dim 1 = 3 is not divisible by "
                                            r"num_key_value_heads = 2"):
        plan_shards({"model.layers.0.self_attn.k_proj.qzeros": [4, 3]}, 4, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize(("degree", "heads", "kv", "message"), [
    (3, 4, 2, "tp degree 3: num_attention_heads = 4 is not divisible by 3"),
    (4, 6, 6, "tp degree 4: num_attention_heads = 6 is not divisible by 4"),
    (3, 6, 2, "tp degree 3: exceeds num_key_value_heads = 2 but is not a multiple of it"),
    (4, 12, 6, "tp degree 4: num_key_value_heads = 6 is not divisible by 4"),
    (0, 4, 2, "tp degree 0: must be >= 1"),
])
def test_degrees_vllm_cannot_serve_are_refused(degree, heads, kv, message):
    shapes = _shapes(hidden=heads * 8, heads=heads, kv=kv, inter=96)
    with pytest.raises(TPDegreeError, match=message) as info:
        plan_shards(shapes, degree, num_heads=heads, num_kv_heads=kv)
    assert info.value.tensor is None
