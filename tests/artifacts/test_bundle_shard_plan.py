"""Tensor-parallel ownership: rules per Llama-family name, rank ranges, and refusals."""

from __future__ import annotations

import pytest

from artifacts.errors import BundleError
from artifacts.shard_plan import TPDegreeError, plan_shards, rank_tensors, split_rule


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
    owned = rank_tensors(plan, degree - 1)
    assert owned["model.layers.0.input_layernorm.weight"] is None
    if degree == 2:
        assert owned["model.layers.0.mlp.down_proj.weight"] == (1, 64, 128)
    with pytest.raises(BundleError, match="out of range"):
        rank_tensors(plan, degree)


def test_undividable_vocab_is_replicated():
    plan = plan_shards(_shapes(vocab=301), 2, num_heads=4, num_kv_heads=2)
    assert plan.tensors["model.embed_tokens.weight"].kind == "replicate"
    assert plan.tensors["lm_head.weight"].kind == "replicate"


def test_dimension_that_does_not_divide_names_tensor_and_dims():
    with pytest.raises(TPDegreeError, match=r"tp degree 3: tensor model\.layers\.0\.self_attn\.q_proj\.weight "
                                            r"shape \[64, 64\] dim 0 = 64 is not divisible by 3") as info:
        plan_shards(_shapes(), 3, num_heads=4, num_kv_heads=2)
    assert info.value.tensor == "model.layers.0.self_attn.q_proj.weight"


def test_heads_and_kv_heads_must_divide():
    # 12 heads of 8 dims = 96: every dimension divides by 4, but KV heads (2) do not.
    shapes = _shapes(hidden=96, heads=12, kv=2, inter=128, vocab=300)
    with pytest.raises(TPDegreeError, match="num_key_value_heads = 2 is not divisible by 4"):
        plan_shards(shapes, 4, num_heads=12, num_kv_heads=2)
    with pytest.raises(TPDegreeError, match="num_attention_heads = 6 is not divisible by 4"):
        plan_shards(_shapes(hidden=96, heads=6, kv=6, inter=128), 4, num_heads=6, num_kv_heads=6)
    with pytest.raises(TPDegreeError, match="must be >= 1"):
        plan_shards(shapes, 0, num_heads=12, num_kv_heads=2)
