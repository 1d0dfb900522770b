"""Consistency checks over the KV bookkeeping: every block's reference count equals the
tables and pins pointing at it, every page is free or under exactly one live block, and the
prefix cache's nodes, exact-match entries and block owners agree. The tests run them after
every operation they drive; KV_CHECK_INTEGRITY=1 runs them whenever the engine goes idle.
They walk every block, so they are for tests and debugging, not for each step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from engine.kv.block_pool import Block, BlockPool
from engine.kv.block_tables import SeqBlocks
from engine.kv.prefix_cache import ExactEntry, PrefixCache, RadixNode


class KVIntegrityError(AssertionError):
    """The KV bookkeeping contradicts itself (a bug, never a user's error)."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise KVIntegrityError(message)


def check_pool(pool: BlockPool) -> None:
    """A pool's blocks are each held or cached, never on a free page, and its counts add up."""
    pages = pool.page_pool
    free = pages.free_pages()
    _require(len(free) == len(set(free)), "a page is twice in the free queue")
    cached = pages.cached_blocks()
    _require(sum(len(b.pages) for b in cached) == pages.num_cached_pages, "cached page count")
    for block in pool.live.values():
        _require(not set(block.pages) & set(free), f"{block!r} is on a free page")
        if block in cached:
            _require(block.ref_count == 0 and block.owner is not None, f"cached {block!r}")
        else:
            _require(block.ref_count > 0, f"{block!r} is neither held nor cached")
    _require(pool.num_cached_unused == sum(b.group == pool.group for b in cached), "cached count")
    _require(pool.num_cached_unused + pool.num_in_use == len(pool.live), "live block count")


def live_nodes(cache: PrefixCache) -> list[RadixNode]:
    """Every node of the radix trees below their roots."""
    nodes = []
    stack = list(cache.roots.values())
    while stack:
        node = stack.pop()
        if node.parent is not None:
            nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def check_cache(cache: PrefixCache) -> None:
    """Nodes hang under their parents with a primary block each, entries point at live
    nodes, and every cached block's owner names it."""
    nodes = live_nodes(cache)
    _require(len(nodes) == cache.num_nodes, "node count")
    for node in nodes:
        _require(not node.detached, f"live node {node!r} is detached")
        _require(cache.primary in node.blocks, "a live node lost its primary block")
        _require(node.parent is not None and node.parent.children[node.key] is node, "parent link")
        for group, block in node.blocks.items():
            _require(block.owner is node and block.group == group, f"owner of {block!r}")
    for key, entry in cache.exact_entries().items():
        _require(
            entry.key == key and not entry.node.detached and key in entry.node.exact_keys,
            f"exact-match entry {key!r}",
        )
        for group, block in (entry.tail or {}).items():
            _require(block.owner is entry and block.group == group, f"owner of {block!r}")
    for pool in cache.pools.values():
        for block in pool.live.values():
            if isinstance(block.owner, RadixNode):
                _require(block.owner.blocks.get(block.group) is block, f"node of {block!r}")
            elif isinstance(block.owner, ExactEntry):
                tail = block.owner.tail or {}
                _require(tail.get(block.group) is block, f"entry of {block!r}")


def check_references(
    pools: Mapping[str, BlockPool], states: Iterable[SeqBlocks], pinned: Iterable[Block]
) -> None:
    """Every live block's ref_count equals the table entries of `states` and the pin
    references (`pinned`, one per pin and block) pointing at it; every page is free or
    under exactly one live block, of whichever group."""
    held: dict[str, Counter[int]] = {group: Counter() for group in pools}
    for state in states:
        for group, table in state.tables.items():
            held[group].update(b.block_id for b in table if b is not None)
    for block in pinned:
        held[block.group][block.block_id] += 1
    for group, pool in pools.items():
        for block in pool.live.values():
            _require(
                block.ref_count == held[group][block.block_id],
                f"{block!r} has {block.ref_count} references, "
                f"{held[group][block.block_id]} holders",
            )
    for page_pool in {pool.page_pool for pool in pools.values()}:
        pages = page_pool.free_pages() + [
            page
            for pool in pools.values()
            if pool.page_pool is page_pool
            for block in pool.live.values()
            for page in block.pages
        ]
        _require(sorted(pages) == list(range(page_pool.num_pages)), "pages lost or shared")


def check_all(
    pools: Mapping[str, BlockPool],
    cache: PrefixCache,
    states: Iterable[SeqBlocks],
    pinned: Iterable[Block],
) -> None:
    """Every check above, over a KV manager's parts."""
    for pool in pools.values():
        check_pool(pool)
    check_cache(cache)
    check_references(pools, states, pinned)
