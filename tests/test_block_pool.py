import pytest

from engine.kv.block_pool import BlockPool, NoFreeBlocksError
from engine.kv.integrity import check_pool


def test_allocates_in_free_queue_order_and_returns_to_the_back():
    pool = BlockPool("full", 4)
    a, b = pool.allocate(), pool.allocate()
    assert (a.block_id, b.block_id) == (0, 1)
    assert (a.ref_count, pool.num_free, pool.num_in_use) == (1, 2, 2)
    pool.decref(a)
    assert [pool.allocate().block_id for _ in range(3)] == [2, 3, 0]
    assert pool.num_available == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    check_pool(pool)


def test_refcounts():
    pool = BlockPool("full", 2)
    block = pool.allocate()
    pool.incref(block)
    pool.incref(block)
    assert block.ref_count == 3
    pool.decref(block)
    pool.decref(block)
    assert (block.ref_count, pool.num_free) == (1, 1)
    pool.decref(block)
    assert (block.ref_count, pool.num_free) == (0, 2)
    with pytest.raises(RuntimeError):
        pool.decref(block)
    with pytest.raises(RuntimeError):
        pool.incref(block)  # a free block cannot be taken by reference
    check_pool(pool)


def test_cached_block_stays_reusable_until_reclaimed():
    pool = BlockPool("full", 2)
    owner = object()
    block = pool.allocate()
    pool.own(block, owner)
    pool.decref(block)
    assert (pool.num_free, pool.num_cached_unused, pool.num_available) == (1, 1, 2)
    pool.incref(block)  # a prefix-cache hit takes it back
    assert (block.ref_count, pool.num_cached_unused, pool.num_in_use) == (1, 0, 1)
    pool.decref(block)
    assert pool.reclaim_order() == [block.block_id]
    check_pool(pool)


def test_reclaims_cached_blocks_least_recently_released_first():
    pool = BlockPool("full", 4)
    forgotten = []

    def forget(block):
        forgotten.append(block.block_id)
        pool.disown(block)

    pool.reclaim_handler = forget
    blocks = [pool.allocate() for _ in range(4)]
    for block in blocks:
        pool.own(block, "cache")
    for i in (2, 0, 3, 1):
        pool.decref(blocks[i])
    assert pool.reclaim_order() == [2, 0, 3, 1]
    assert (pool.num_free, pool.num_available) == (0, 4)
    got = [pool.allocate() for _ in range(3)]
    assert [b.block_id for b in got] == [2, 0, 3]
    assert forgotten == [2, 0, 3]
    assert all(b.owner is None and b.ref_count == 1 for b in got)
    assert pool.num_reclaimed == 3
    assert pool.reclaim_order() == [1]
    check_pool(pool)


def test_disown_returns_an_unheld_cached_block_to_the_free_queue():
    pool = BlockPool("full", 2)
    held, cached = pool.allocate(), pool.allocate()
    pool.own(held, "cache")
    pool.own(cached, "cache")
    pool.decref(cached)
    pool.disown(cached)
    pool.disown(held)
    assert (pool.num_free, pool.num_cached_unused, pool.num_in_use) == (1, 0, 1)
    pool.decref(held)  # no longer cached: straight back to the free queue
    assert (pool.num_free, pool.num_cached_unused) == (2, 0)
    with pytest.raises(RuntimeError):
        pool.own(held, "cache")  # only held blocks can become cached
    check_pool(pool)
