"""Shared checks and drivers for the KV manager tests: exact bookkeeping invariants and a
minimal stand-in for the engine loop (allocate -> advance -> commit)."""

from __future__ import annotations

from collections import Counter

from engine.kv.block_pool import BlockPool
from engine.kv.manager import KVCacheManager
from engine.kv.prefix_cache import ExactEntry, PrefixCache, RadixNode
from engine.request import Sequence
from engine.runner import build_forward_batch
from engine.sampling import SamplingParams
from engine.sched.output import ScheduledSeq


def make_seq(tokens: list[int], **kwargs) -> Sequence:
    sampling = SamplingParams(max_tokens=1000)
    return Sequence(prompt_token_ids=list(tokens), sampling=sampling, **kwargs)


def attended_keys(
    kv: KVCacheManager, seq: Sequence, num_new: int
) -> dict[str, tuple[list[int], list[int]]]:
    """Per group, (slots, positions) of the keys seq attends to in a step computing num_new
    more tokens (allocated already), as the model runner addresses them."""
    scheduled = ScheduledSeq(seq, seq.num_computed_tokens, num_new, True, kv.address(seq, num_new))
    groups = build_forward_batch([scheduled], list(kv.pools), kv.block_size).groups
    return {
        name: (g.key_slots[0][g.key_valid[0]].tolist(), g.key_positions[0][g.key_valid[0]].tolist())
        for name, g in groups.items()
    }


def step(kv: KVCacheManager, seq: Sequence, num_new: int, sampled: int = 0) -> None:
    """One engine step for seq: slots for num_new tokens, compute them, sample once the
    sequence has caught up, commit."""
    assert kv.allocate(seq, num_new)
    seq.num_computed_tokens += num_new
    if seq.num_computed_tokens == seq.num_tokens:
        seq.output_token_ids.append(sampled)
    kv.commit(seq)


def prefill(kv: KVCacheManager, seq: Sequence, sampled: int = 0) -> int:
    """match_prefix + one step over the rest of the sequence; returns the cached tokens."""
    cached = kv.match_prefix(seq)
    step(kv, seq, seq.num_tokens - seq.num_computed_tokens, sampled)
    return cached


def decode(kv: KVCacheManager, seq: Sequence, tokens: list[int]) -> None:
    for token in tokens:
        step(kv, seq, 1, token)


def check_pool(pool: BlockPool) -> None:
    pages = pool.page_pool
    free = list(pages._free)
    assert len(free) == len(set(free)), "a page is twice in the free queue"
    cached = pages.cached_blocks()
    assert sum(len(b.pages) for b in cached) == pages.num_cached_pages
    for block in pool.live.values():
        assert not set(block.pages) & set(free), f"{block!r} is on a free page"
        if block in cached:
            assert block.ref_count == 0 and block.owner is not None, block
        else:
            assert block.ref_count > 0, f"{block!r} is neither held nor cached"
    assert pool.num_cached_unused == sum(b.group == pool.group for b in cached)
    assert pool.num_cached_unused + pool.num_in_use == len(pool.live)


def live_nodes(cache: PrefixCache) -> list[RadixNode]:
    nodes = []
    stack = list(cache.roots.values())
    while stack:
        node = stack.pop()
        if node.parent is not None:
            nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def check_cache(cache: PrefixCache) -> None:
    nodes = live_nodes(cache)
    assert len(nodes) == cache.num_nodes
    for node in nodes:
        assert not node.detached
        assert cache.primary in node.blocks, "a live node lost its primary block"
        assert node.parent.children[node.key] is node
        for group, block in node.blocks.items():
            assert block.owner is node and block.group == group
    for key, entry in cache._exact.items():
        assert entry.key == key and not entry.node.detached and key in entry.node.exact_keys
        for group, block in (entry.tail or {}).items():
            assert block.owner is entry and block.group == group
    for pool in cache.pools.values():
        for block in pool.live.values():
            if isinstance(block.owner, RadixNode):
                assert block.owner.blocks.get(block.group) is block
            elif isinstance(block.owner, ExactEntry):
                assert block.owner.tail[block.group] is block


def check_manager(kv: KVCacheManager) -> None:
    """Every block's ref_count equals the number of block-table entries and session pins
    pointing at it."""
    for pool in kv.pools.values():
        check_pool(pool)
    check_cache(kv.cache)
    held: dict[str, Counter] = {g: Counter() for g in kv.pools}
    for state in kv._seqs.values():
        for group, table in state.tables.items():
            held[group].update(b.block_id for b in table if b is not None)
    for pin in kv.pins._pins.values():  # a session pin holds one reference per block
        for block in pin.blocks:
            held[block.group][block.block_id] += 1
    for group, pool in kv.pools.items():
        for block in pool.live.values():
            assert block.ref_count == held[group][block.block_id], block
    # Every page is free or under exactly one live block, of whichever group.
    for page_pool in {pool.page_pool for pool in kv.pools.values()}:
        pages = list(page_pool._free) + [
            page
            for pool in kv.pools.values()
            if pool.page_pool is page_pool
            for block in pool.live.values()
            for page in block.pages
        ]
        assert sorted(pages) == list(range(page_pool.num_pages))


def assert_all_released(kv: KVCacheManager) -> None:
    check_manager(kv)
    assert kv.num_free_blocks == kv.pools[kv.primary].num_total
    for pool in kv.pools.values():
        assert pool.num_in_use == 0
        assert pool.num_available == pool.num_total
