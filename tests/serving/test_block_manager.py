"""BlockManager: reference counts, prefix-hash sharing, freeing on finish and abort."""

from __future__ import annotations

from serving.engine.block_manager import BlockManager
from serving.engine.sampling_params import SamplingParams
from serving.engine.sequence import Sequence


def seq(rid: str, tokens: list[int], **params) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(**params))


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    """What the engine does for a whole prompt: admit, reserve slots, compute, commit hashes."""
    bm.admit(s)
    n = s.num_tokens - s.num_computed_tokens
    assert bm.ensure_slots(s, n)
    s.num_computed_tokens += n
    bm.commit_full_blocks(s)


def tokens_from_cache(bm: BlockManager, first: list[int], second: list[int], **params) -> int:
    """Prefill ``first``, then admit ``second``: how many of its tokens the prefix cache supplies."""
    run_prefill(bm, seq("a", first))
    b = seq("b", second, **params)
    bm.admit(b)
    return b.num_computed_tokens


def test_allocation_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq("a", range(10))
    run_prefill(bm, s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert all(bm.ref_counts[b] == 1 for b in s.block_table)
    bm.free_seq(s)
    assert bm.num_free_blocks == 8 and bm.usage() == 0.0 and s.block_table == []


def test_ensure_slots_fails_without_allocating_when_blocks_run_out():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq("a", range(6))
    bm.admit(s)
    assert not bm.ensure_slots(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_shared_prefix_blocks_are_shared_by_reference_and_counted_as_hits():
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(100, 112))  # three full blocks
    a, b = seq("a", system + [1, 2]), seq("b", system + [7, 8, 9])
    run_prefill(bm, a)
    used_after_a = bm.num_used_blocks
    bm.admit(b)
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert b.block_table[:3] == a.block_table[:3]
    assert all(bm.ref_counts[x] == 2 for x in a.block_table[:3])
    assert bm.num_used_blocks == used_after_a  # sharing allocated nothing new
    assert bm.prefix_cache_hits == 12 and bm.prefix_cache_queries == a.num_tokens + b.num_tokens
    # freeing one owner keeps the shared blocks alive for the other
    bm.free_seq(a)
    assert all(bm.ref_counts[x] == 1 for x in b.block_table[:3])
    bm.free_seq(b)
    assert bm.usage() == 0.0


def test_freed_blocks_keep_their_hash_until_reused():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(50, 59))
    a = seq("a", prompt)
    run_prefill(bm, a)
    bm.free_seq(a)  # finished
    b = seq("b", prompt)
    bm.admit(b)
    assert b.num_computed_tokens == 8  # two full blocks revived from the free list
    assert bm.num_used_blocks == 2


def test_chain_hash_depends_on_the_whole_prefix():
    bm = BlockManager(num_blocks=16, block_size=4)
    # same second block, different first block
    assert tokens_from_cache(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 9, 9, 9, 5, 6, 7, 8, 9]) == 0


def test_full_prompt_hit_still_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert tokens_from_cache(bm, range(8), range(8)) == 4  # the last block is recomputed so the model yields logits


def test_prefix_caching_off_and_prompt_logprobs_skip_the_cache():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    assert tokens_from_cache(bm, range(9), range(9)) == 0 and bm.prefix_cache_queries == 0
    bm2 = BlockManager(num_blocks=8, block_size=4)
    assert tokens_from_cache(bm2, range(9), range(9), prompt_logprobs=0) == 0


def test_reused_block_drops_its_stale_hash():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq("a", range(5))
    run_prefill(bm, a)
    bm.free_seq(a)
    big = seq("big", range(100, 108))  # takes both blocks, evicting a's cached block
    run_prefill(bm, big)
    bm.free_seq(big)
    c = seq("c", range(5))
    bm.admit(c)
    assert c.num_computed_tokens == 0
