from engine.kv.block_pool import BlockPool
from engine.kv.block_tables import BlockCopy
from engine.kv.integrity import check_cache
from engine.kv.layout import CacheGroupSpec
from engine.kv.manager import KVCacheManager
from engine.kv.prefix_cache import PrefixCache
from tests.kv_invariants import (
    assert_all_released,
    check_manager,
    decode,
    make_seq,
    prefill,
)

BS = 4
FULL = CacheGroupSpec("full", (0,), None, 64)


def make_cache(full_blocks=8, sliding_blocks=None, window=None):
    pools = {"full": BlockPool("full", full_blocks)}
    windows = {"full": None}
    if sliding_blocks is not None:
        pools["sliding"] = BlockPool("sliding", sliding_blocks)
        windows["sliding"] = window
    cache = PrefixCache(pools, "full", BS, windows)
    for pool in pools.values():
        pool.reclaim_handler = cache.forget_block
    return cache, pools


def insert_chain(cache, pools, tokens, salt=None, groups=("full",)):
    """Insert tokens' full blocks with freshly allocated (held) blocks; returns the nodes."""
    parent, nodes = cache.root(salt), []
    for start in range(0, len(tokens) - BS + 1, BS):
        blocks = {g: pools[g].allocate() for g in groups}
        parent = cache.insert(parent, tuple(tokens[start : start + BS]), blocks)
        nodes.append(parent)
    return nodes


def test_insert_and_match_the_longest_block_aligned_prefix():
    cache, pools = make_cache()
    tokens = list(range(12))
    nodes = insert_chain(cache, pools, tokens)
    assert cache.num_nodes == 3
    assert [n.blocks["full"].block_id for n in nodes] == [0, 1, 2]

    longer = cache.match([*tokens, 99], None)
    assert longer.num_tokens == 12 and not longer.exact
    assert [b.block_id for b in longer.tables["full"]] == [0, 1, 2]
    assert cache.match(tokens[:10], None).num_tokens == 8  # the partial block is not cached
    diverging = [*tokens[:6], 50, 51, 52, 53, 54]  # differs inside block 1
    assert cache.match(diverging, None).num_tokens == 4
    # Every token cached: the last one is still recomputed, so the match stops one short.
    whole = cache.match(tokens, None)
    assert whole.num_tokens == 11 and len(whole.tables["full"]) == 3
    assert cache.match([7], None).num_tokens == 0
    assert cache.match(tokens, "other-salt").num_tokens == 0
    assert cache.stats() | {"hit_rate": None} == {
        "queries": 6,
        "query_tokens": 13 + 10 + 11 + 12 + 1 + 12,
        "hit_tokens": 12 + 8 + 4 + 11,
        "hit_rate": None,
        "exact_hits": 0,
        "nodes": 3,
        "exact_entries": 0,
        "evicted_nodes": 0,
    }


def test_a_divergent_insert_branches_at_the_block_boundary():
    cache, pools = make_cache()
    a = insert_chain(cache, pools, list(range(12)))
    b = insert_chain(cache, pools, [0, 1, 2, 3, 100, 101, 102, 103, 104, 105, 106, 107])
    assert b[0] is a[0]  # the shared first block is one node
    assert len(a[0].children) == 2 and b[1] is not a[1]
    assert cache.num_nodes == 5
    # The second insert's own copy of block 0 was not adopted: the node keeps the first one.
    assert pools["full"].live[3].owner is None
    assert cache.match([0, 1, 2, 3, 100, 101, 102, 103, 9], None).num_tokens == 8
    check_cache(cache)


def test_reclaiming_an_inner_block_drops_its_subtree_but_not_held_blocks():
    cache, pools = make_cache(full_blocks=3)
    pool = pools["full"]
    nodes = insert_chain(cache, pools, list(range(12)))
    first, second, third = (n.blocks["full"] for n in nodes)
    pool.decref(first)  # only the inner block is unreferenced (an eviction policy did this)
    reused = pool.allocate()
    assert reused.pages == first.pages and reused.owner is None and first.owner is None
    assert cache.num_nodes == 0 and all(n.detached for n in nodes)
    assert cache.roots == {}
    assert second.owner is None and third.owner is None  # still held, no longer cached
    pool.decref(second)
    assert pool.num_free == 1 and pool.num_cached_unused == 0
    check_cache(cache)


def test_losing_a_sliding_block_keeps_the_node_and_shortens_matches():
    cache, pools = make_cache(full_blocks=8, sliding_blocks=2, window=4)
    tokens = list(range(12))
    parent, nodes = cache.root(None), []
    for i in range(3):
        blocks = {"full": pools["full"].allocate()}
        if i < 2:
            blocks["sliding"] = pools["sliding"].allocate()
        parent = cache.insert(parent, tuple(tokens[i * BS : (i + 1) * BS]), blocks)
        nodes.append(parent)
    for i in (1, 0):
        pools["sliding"].decref(nodes[i].blocks["sliding"])
    # Position 12 needs sliding keys from 8 (block 2: missing), so 8 is the longest usable.
    assert cache.match([*tokens, 99], None).num_tokens == 8
    reclaimed = pools["sliding"].allocate()  # free queue empty: LRU is node 1's sliding block
    assert reclaimed.block_id == 1 and "sliding" not in nodes[1].blocks
    assert cache.num_nodes == 3
    assert cache.match([*tokens, 99], None).num_tokens == 4
    check_cache(cache)


def test_leaves_are_reclaimed_least_recently_used_first():
    kv = KVCacheManager([FULL], num_blocks=6, block_size=BS)
    a = make_seq(list(range(12)))
    prefill(kv, a)
    kv.free(a)
    assert kv.pools["full"].reclaim_order() == [2, 1, 0]  # released deepest first
    b = make_seq(list(range(200, 208)))
    prefill(kv, b)
    assert kv.tables.layout(b)["full"] == [(3, 0), (4, 1)]
    c = make_seq(list(range(300, 312)))
    assert kv.match_prefix(c) == 0 and kv.allocate(c, 12)
    assert kv.tables.layout(c)["full"] == [(5, 0), (2, 1), (1, 2)]  # free block, then a's leaves
    assert kv.cache.num_nodes == 3  # a's first block + b's two
    assert kv.stats()["groups"]["full"]["reclaimed"] == 2
    again = make_seq(list(range(12)))
    assert kv.match_prefix(again) == 4
    check_manager(kv)
    for seq in (b, c, again):
        kv.free(seq)
    assert_all_released(kv)


def test_exact_index_reuses_a_repeated_prompt_including_its_partial_block():
    kv = KVCacheManager([FULL], num_blocks=8, block_size=BS)
    prompt = list(range(10))
    a = make_seq(prompt)
    prefill(kv, a, sampled=77)
    kv.free(a)  # a's partial block 2 (tokens 8, 9) now belongs to the exact-match index
    assert kv.cache.num_exact_entries == 1 and kv.cache.num_nodes == 2
    assert kv.pools["full"].reclaim_order() == [2, 1, 0]

    b = make_seq(prompt)
    assert kv.match_prefix(b) == 9  # all but the last prompt token
    assert (b.num_computed_tokens, b.num_cached_prompt_tokens) == (9, 9)
    assert kv.tables.layout(b)["full"] == [(0, 0), (1, 1), (2, 2)]
    assert kv.allocate(b, 1)
    # Block 2 is cached, and b writes position 9 into it: b gets its own copy first.
    assert kv.take_block_copies() == [BlockCopy("full", 2, 3)]
    assert kv.take_block_copies() == []
    assert kv.tables.layout(b)["full"] == [(0, 0), (1, 1), (3, 2)]
    assert kv.tables.slots_for_new_tokens(b, 1) == {"full": [3 * BS + 1]}
    stats = kv.stats()
    assert stats["cow_copies"] == 1
    keys = ("queries", "query_tokens", "hit_tokens", "exact_hits")
    assert {k: stats["prefix_cache"][k] for k in keys} == {
        "queries": 2,
        "query_tokens": 20,
        "hit_tokens": 9,
        "exact_hits": 1,
    }
    check_manager(kv)
    kv.free(b)
    assert_all_released(kv)


def test_exact_index_points_at_the_node_once_output_fills_the_prompt_block():
    kv = KVCacheManager([FULL], num_blocks=8, block_size=BS)
    prompt = list(range(10))
    a = make_seq(prompt)
    prefill(kv, a, sampled=70)
    decode(kv, a, [71, 72])  # tokens 8..11 = 8, 9, 70, 71: block 2 is full and published
    assert kv.cache.num_nodes == 3
    kv.free(a)
    b = make_seq(prompt)
    assert kv.match_prefix(b) == 9
    assert kv.cache.stats()["exact_hits"] == 1
    assert kv.tables.layout(b)["full"] == [(0, 0), (1, 1), (2, 2)]
    assert kv.allocate(b, 1)
    assert kv.take_block_copies() == [BlockCopy("full", 2, 3)]
    kv.free(b)
    assert_all_released(kv)


def test_exact_entry_is_dropped_when_its_partial_block_is_reclaimed():
    kv = KVCacheManager([FULL], num_blocks=4, block_size=BS)
    prompt = list(range(10))
    a = make_seq(prompt)
    prefill(kv, a)
    kv.free(a)
    other = make_seq(list(range(100, 106)))
    prefill(kv, other)  # takes free block 3, then reclaims the LRU block: a's partial block 2
    assert kv.tables.layout(other)["full"] == [(3, 0), (2, 1)]
    assert kv.cache.num_exact_entries == 1  # other's own prompt; a's entry is gone
    kv.free(other)
    b = make_seq(prompt)
    assert kv.match_prefix(b) == 8  # the radix tree still has the two full blocks
    assert kv.cache.stats()["exact_hits"] == 0
    kv.free(b)
    assert_all_released(kv)


def test_whole_sequence_in_full_blocks_recomputes_only_the_last_token():
    kv = KVCacheManager([FULL], num_blocks=8, block_size=BS)
    a = make_seq(list(range(12)))
    prefill(kv, a)
    kv.free(a)
    b = make_seq(list(range(8)))  # a different prompt: found through the tree, not the index
    assert kv.match_prefix(b) == 7
    assert kv.allocate(b, 1)
    assert kv.take_block_copies() == [BlockCopy("full", 1, 3)]
    assert kv.tables.layout(b)["full"] == [(0, 0), (3, 1)]
    kv.free(b)
    assert_all_released(kv)


def test_salts_never_share():
    kv = KVCacheManager([FULL], num_blocks=16, block_size=BS)
    prompt = list(range(9))
    alice = make_seq(prompt, cache_salt="alice")
    prefill(kv, alice)
    kv.free(alice)
    assert kv.match_prefix(make_seq(prompt, cache_salt="bob")) == 0
    assert kv.match_prefix(make_seq(prompt)) == 0  # no salt is its own namespace too
    again = make_seq(prompt, cache_salt="alice")
    assert kv.match_prefix(again) == 8
    assert set(kv.cache.roots) >= {"alice"}
    check_manager(kv)


def test_concurrent_identical_prompts_end_up_sharing_blocks():
    kv = KVCacheManager([FULL], num_blocks=16, block_size=BS)
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    assert kv.match_prefix(a) == 0 and kv.match_prefix(b) == 0  # nothing cached yet
    assert kv.allocate(a, 9) and kv.allocate(b, 9)
    assert kv.tables.layout(b)["full"] == [(3, 0), (4, 1), (5, 2)]
    for seq in (a, b):
        seq.num_computed_tokens = 9
        seq.output_token_ids.append(1)
        kv.commit(seq)
    # b found a's published blocks and switched to them, freeing its own duplicates.
    assert kv.tables.layout(b)["full"] == [(0, 0), (1, 1), (5, 2)]
    assert kv.pools["full"].live[0].ref_count == 2
    assert kv.num_free_blocks == 16 - 4
    check_manager(kv)
    kv.free(a)
    kv.free(b)
    assert_all_released(kv)


def test_prefix_caching_off_shares_nothing():
    kv = KVCacheManager([FULL], num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_seq(list(range(12)))
    prefill(kv, a)
    kv.free(a)
    assert kv.pools["full"].num_free == 8 and kv.cache.num_nodes == 0
    assert kv.match_prefix(make_seq(list(range(12)))) == 0
    assert kv.cache.stats()["queries"] == 0
