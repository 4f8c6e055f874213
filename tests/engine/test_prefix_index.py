"""The leader's prefix-cache index: chained block hashes, LRU within a budget, pins."""

from __future__ import annotations

from meshllm.engine.prefix_index import PrefixIndex, block_hashes


def test_hashes_chain_so_equal_hashes_mean_equal_prefixes():
    a = block_hashes(list(range(40)), 8, salt=1)
    b = block_hashes(list(range(40)) + [7, 7], 8, salt=1)
    c = block_hashes([99] + list(range(1, 40)), 8, salt=1)
    assert len(a) == 5 and a == b[:5]
    assert not set(a) & set(c)  # a different first block changes every later hash
    assert block_hashes(list(range(40)), 8, salt=2) != a  # leaders do not share blocks


def test_match_leaves_one_prompt_token_to_compute_and_counts_hits():
    index = PrefixIndex(block_size=8, capacity_blocks=10)
    hashes = block_hashes(list(range(32)), 8, salt=0)
    index.insert(hashes)
    assert index.match(hashes, num_prompt_tokens=32) == 3  # the last block stays: its logits are needed
    assert index.match(hashes, num_prompt_tokens=40) == 4
    assert index.num_hit_tokens == 24 + 32 and index.num_miss_tokens == 8 + 8


def test_lru_eviction_skips_pinned_blocks():
    index = PrefixIndex(block_size=4, capacity_blocks=3)
    new, evicted = index.insert([1, 2, 3])
    assert new == [1, 2, 3] and evicted == []
    index.match([1], num_prompt_tokens=100)  # 1 is now the most recently used
    index.pin([2])
    new, evicted = index.insert([4, 5])
    assert new == [4, 5] and evicted == [3, 1]  # 2 is pinned; 3 was least recently used
    index.unpin([2])
    _, evicted = index.insert([6])
    assert evicted == [2]
    assert len(index) == 3 and 2 not in index
