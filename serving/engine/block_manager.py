"""Paged KV-cache bookkeeping: fixed-size blocks, a free list, reference counts, prefix hashes.

The tensors live in the model runner; this class only decides which block ids a sequence owns.
A full block is identified by a chained hash (hash of the previous block's hash and its own token
ids), so two sequences sharing a prompt prefix share the blocks holding it (copy-free, by reference
count). Freed blocks keep their hash until they are handed out again, so a later request with the same
prefix (a shared system prompt) finds them and skips that part of its prefill.

Bookkeeping grows with the blocks in use, not with the cache: blocks never handed out are one counter
(``_fresh``, every id from it up is unused), and counts and hashes live in dicts. A GPU cache sized from the
device's memory can hold tens of millions of blocks of a small model; a list or free-list entry per block cost
seconds and gigabytes of host memory at every engine start.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

from serving.engine.sequence import Sequence


def chain_hash(prev_hash: int, tokens: list[int] | tuple[int, ...]) -> int:
    """Hash of one full block given the hash of the block before it (-1 for the first block)."""
    return hash((prev_hash, tuple(tokens)))


class BlockManager:
    """Owns block ids ``0..num_blocks-1``; hands them to sequences and takes them back."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts: defaultdict[int, int] = defaultdict(int)  # block -> live references (absent: 0)
        self.block_hash: dict[int, int] = {}  # a full block's chained hash, kept while it is free
        self.block_tokens: dict[int, tuple[int, ...]] = {}
        self.hash_to_block: dict[int, int] = {}
        # blocks used before and free now, least recently freed first (evicted first); O(1) removal on a prefix
        # hit. Blocks never used (ids from ``_fresh`` up) are handed out before any of these.
        self.free: OrderedDict[int, None] = OrderedDict()
        self._fresh = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + self.num_blocks - self._fresh

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (cached-but-free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _lookup_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached run of ``seq``'s full blocks (at least one token left)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        hits: list[int] = []
        prev = seq.hash_root
        bs = self.block_size
        limit = (seq.num_tokens - 1) // bs  # keep >= 1 token to compute so we get logits
        for i in range(limit):
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(prev, toks)
            b = self.hash_to_block.get(h)
            if b is None or self.block_tokens.get(b) != toks:
                break
            hits.append(b)
            prev = h
        return hits

    # ----------------------------------------------------------------- allocation
    def can_admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``seq`` (no blocks yet) can start with ``num_new_tokens`` beyond its cached prefix."""
        hits = self._lookup_prefix(seq)
        revived = sum(1 for b in hits if not self.ref_counts.get(b))
        computed = len(hits) * self.block_size
        need = self.blocks_for(computed + num_new_tokens) - len(hits)
        return need + revived <= self.num_free_blocks

    def admit(self, seq: Sequence) -> int:
        """Attach the cached prefix blocks to ``seq``; returns the number of tokens already computed."""
        assert not seq.block_table, "admit() is for sequences holding no blocks"
        hits = self._lookup_prefix(seq)
        prev = -1
        for b in hits:
            if not self.ref_counts.get(b):
                del self.free[b]
            self.ref_counts[b] += 1
            seq.block_table.append(b)
            prev = self.block_hash[b]
            seq.block_hashes.append(prev)
        cached = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += cached
        seq.num_computed_tokens = cached
        seq.num_cached_tokens = cached
        return cached

    def ensure_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_new_tokens`` more tokens; False if blocks ran out."""
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            if self._fresh < self.num_blocks:
                b = self._fresh
                self._fresh += 1
            else:
                b, _ = self.free.popitem(last=False)
            old = self.block_hash.pop(b, None)
            if old is not None:
                if self.hash_to_block.get(old) == b:
                    del self.hash_to_block[old]
                del self.block_tokens[b]
            self.ref_counts[b] = 1
            seq.block_table.append(b)
        return True

    def commit_full_blocks(self, seq: Sequence, computed: int | None = None) -> None:
        """Register hashes of blocks that became full of computed tokens, for later prefix hits. ``computed``: the
        tokens whose KV is known written (a step's end, when a later step is still in flight), else all of
        ``num_computed_tokens``."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min((seq.num_computed_tokens if computed is None else computed) // bs, len(seq.block_table))
        prev = seq.block_hashes[-1] if seq.block_hashes else seq.hash_root
        for i in range(len(seq.block_hashes), full):
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(prev, toks)
            b = seq.block_table[i]
            if h not in self.hash_to_block:
                self.hash_to_block[h] = b
                self.block_hash[b] = h
                self.block_tokens[b] = toks
            seq.block_hashes.append(h)
            prev = h

    def free_seq(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks reaching zero return to the free list (tail first)."""
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                del self.ref_counts[b]
                self.free[b] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
