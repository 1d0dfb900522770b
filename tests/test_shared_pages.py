"""Cache groups sharing one pool of pages (engine.kv.layout.SharedPages): the page and block
bookkeeping as pure logic with exact values, the KV manager's admission counted in pages, and
the model runner reading the same K/V from shared pages as from a pool per group (logits
equal bit for bit, and equal to transformers')."""

from __future__ import annotations

import pytest
import torch

from engine.backends.custom import CustomBackend
from engine.kv.block_pool import BlockPool, NoFreeBlocksError, PagePool
from engine.kv.block_tables import BlockCopy
from engine.kv.integrity import check_pool
from engine.kv.layout import CacheGroupSpec, LanePlace, SharedPages
from engine.kv.manager import KVCacheManager
from engine.kv.sizing import can_share_pages, lanes_per_page, shared_pages
from engine.model import cpu_ops
from engine.runner import ModelRunner
from engine.sched.output import plan_of
from tests import test_forward_gemma3 as gemma3
from tests import test_forward_gemma4 as gemma4
from tests.forward_contract import prompt
from tests.kv_invariants import assert_all_released, check_manager, make_seq, step
from tests.paged_driver import hf_greedy, hf_model

CPU = torch.device("cpu")


# ---------------------------------------------------------------------- block and page pools


def two_pools(num_pages: int) -> tuple[PagePool, BlockPool, BlockPool]:
    pages = PagePool(num_pages)
    return (
        pages,
        BlockPool("full", pages=pages),
        BlockPool("sliding", pages=pages, pages_per_block=3),
    )


def test_blocks_of_both_groups_take_pages_from_one_free_queue():
    pages, full, sliding = two_pools(8)
    a = full.allocate()
    s = sliding.allocate()
    b = full.allocate()
    assert (a.pages, s.pages, b.pages) == ((0,), (1, 2, 3), (4,))
    assert s.block_id == 1  # a block is named by its first page
    assert (pages.num_available, full.num_available, sliding.num_available) == (3, 3, 1)
    assert (full.num_total, sliding.num_total) == (8, 2)
    assert (full.num_in_use, sliding.num_in_use) == (2, 1)
    assert sliding.take_assignments() == [s] and sliding.take_assignments() == []
    assert full.take_assignments() == []  # one-page blocks need no mapping
    sliding.decref(s)  # free: its three pages go to the back of the queue...
    assert pages.num_available == 6 and sliding.num_available == 2
    assert [full.allocate().pages for _ in range(4)] == [(5,), (6,), (7,), (1,)]
    assert (pages.num_available, sliding.num_available, full.num_available) == (2, 0, 2)
    with pytest.raises(NoFreeBlocksError):
        sliding.allocate()  # pages 2 and 3 are free, a sliding block needs three
    for pool in (full, sliding):
        check_pool(pool)


def test_an_allocation_reclaims_cached_blocks_of_any_group_least_recent_first():
    pages, full, sliding = two_pools(6)
    forgotten = []

    def forget(block):
        forgotten.append((block.group, block.block_id))
        (full if block.group == "full" else sliding).disown(block)

    full.reclaim_handler = sliding.reclaim_handler = forget
    f0, f1, s = full.allocate(), full.allocate(), sliding.allocate()
    held = full.allocate()
    for block, pool in ((s, sliding), (f0, full), (f1, full)):
        pool.own(block, "cache")
    full.decref(f0)
    full.decref(f1)
    sliding.decref(s)
    # No free page, 5 under cached blocks: one sliding block's worth.
    assert (pages.num_free, pages.num_available, sliding.num_available) == (0, 5, 1)
    assert full.reclaim_order() == [0, 1] and sliding.reclaim_order() == [2]
    got = sliding.allocate()
    # Least recently released first, whatever the group, until three pages are free.
    assert forgotten == [("full", 0), ("full", 1), ("sliding", 2)]
    assert got.pages == (0, 1, 2) and (full.num_reclaimed, sliding.num_reclaimed) == (2, 1)
    assert pages.num_free == 2 and full.num_available == 2
    with pytest.raises(NoFreeBlocksError):
        sliding.allocate()
    assert (held.ref_count, held.pages) == (1, (5,))
    for pool in (full, sliding):
        check_pool(pool)


def test_a_pool_of_its_own_is_one_page_per_block():
    pool = BlockPool("full", 3)
    assert (pool.pages_per_block, pool.page_pool.num_pages, pool.num_total) == (1, 3, 3)
    with pytest.raises(ValueError):
        BlockPool("sliding", pages=PagePool(2), pages_per_block=3)  # not one block's worth
    with pytest.raises(ValueError):
        PagePool(0)


# ---------------------------------------------------------------------- sizing

# Gemma 3 270M with a bfloat16 cache: one KV head of 256 dims, 2 * 256 * 2 = 1,024 bytes per
# token and layer; 3 full-attention layers and 15 sliding ones over 512 tokens.
FULL = CacheGroupSpec("full", (5, 11, 17), None, 3 * 1024, (1, 256))
SLIDING = CacheGroupSpec(
    "sliding", tuple(i for i in range(18) if i % 6 != 5), 512, 15 * 1024, (1, 256)
)
BUDGET = 65536 * 18 * 1024  # MAX_ACTIVE_KV_TOKENS=65536 in every layer


def test_pages_are_as_wide_as_the_smallest_group():
    layout = shared_pages([FULL, SLIDING], BUDGET, 16, 64, 512)
    # A page: 16 tokens of 3 layers, 48 KiB; the budget makes 65,536 * 18 / 48 of them.
    assert layout == SharedPages(num_pages=24576, lanes=3, lane_width=256)
    assert (layout.pages_per_block(FULL), layout.pages_per_block(SLIDING)) == (1, 5)
    # A 2,048-token sequence: 128 full pages and 34 sliding blocks of 5, so 82 fit; a split
    # fixed for 64 sequences (blocks_per_group) holds 64, the even split 32.
    assert layout.num_pages // (128 + 34 * 5) == 82


def test_an_automatic_budget_is_capped_at_what_the_sequences_could_hold():
    layout = shared_pages([FULL, SLIDING], BUDGET, 16, 4, 512, max_context_tokens=4 * 1000)
    # 250 full blocks for 4,000 tokens, 4 windows of 34 sliding blocks plus 32 of chunks.
    assert layout == SharedPages(250 + (4 * 34 + 32) * 5, 3, 256)


def test_groups_share_pages_when_their_widths_divide_the_widest():
    assert can_share_pages([FULL, SLIDING])
    assert not can_share_pages([FULL])  # one group: nothing to share
    wide = CacheGroupSpec("full", (5,), None, 2048, (1, 512))  # Gemma 4: wider full layers
    assert can_share_pages([wide, SLIDING])
    other_shape = CacheGroupSpec("full", (5,), None, 1024, (2, 128))  # as wide, other heads
    assert can_share_pages([other_shape, SLIDING])
    assert not can_share_pages([CacheGroupSpec("full", (5,), None, 1536, (1, 384)), SLIDING])
    assert not can_share_pages([FULL, CacheGroupSpec("sliding", (0,), 512, 1024)])


# transformers' default Gemma4TextConfig with a bfloat16 cache: 4 KV heads everywhere, 5
# full-attention layers of 512 dims (4,096 bytes per token and layer) and 25 sliding ones of 256.
WIDE_FULL = CacheGroupSpec("full", tuple(range(5, 30, 6)), None, 5 * 8192, (4, 512))
NARROW_SLIDING = CacheGroupSpec(
    "sliding", tuple(i for i in range(30) if i % 6 != 5), 512, 25 * 4096, (4, 256)
)


def test_narrower_layers_share_a_lane():
    layout = shared_pages([WIDE_FULL, NARROW_SLIDING], 30 * 16 * 8192 * 10, 16, 8, 512)
    # Lanes as wide as a full layer (2,048 elements); two sliding layers fill one, so a block
    # fills 5 lanes of full layers and 13 of sliding ones (the last half empty). Pages of one
    # lane leave no lane unused: 16 tokens x 2,048 x K and V x 2 bytes = 128 KiB a page.
    assert layout == SharedPages(num_pages=300, lanes=1, lane_width=2048)
    assert (layout.pages_per_block(WIDE_FULL), layout.pages_per_block(NARROW_SLIDING)) == (5, 13)
    assert [layout.place(i, 2048) for i in (0, 4)] == [LanePlace(0, 0), LanePlace(4, 0)]
    assert [layout.place(i, 1024) for i in (0, 1, 2, 24)] == [
        LanePlace(0, 0, 0, 2),
        LanePlace(0, 0, 1, 2),
        LanePlace(1, 0, 0, 2),
        LanePlace(12, 0, 0, 2),
    ]
    pages_of_3 = SharedPages(60, 3, 2048)
    assert [pages_of_3.place(i, 1024) for i in (5, 6, 24)] == [
        LanePlace(0, 2, 1, 2),
        LanePlace(1, 0, 0, 2),
        LanePlace(4, 0, 0, 2),
    ]
    assert not LanePlace().moves_slots and not LanePlace(0, 3).moves_slots
    assert LanePlace(0, 0, 1, 2).moves_slots and LanePlace(1, 0).moves_slots
    with pytest.raises(ValueError):
        layout.pages_for(1, 768)  # does not divide a lane


def test_a_page_has_the_most_lanes_that_waste_the_fewest():
    assert lanes_per_page([3, 15]) == 3  # Gemma 3 270M: 3 full layers, 15 sliding ones
    assert lanes_per_page([4, 22]) == 2  # Gemma 3 1B: pages of 4 would leave 2 lanes unused
    assert lanes_per_page([5, 13]) == 1  # the Gemma 4 config above
    assert lanes_per_page([2, 3]) == 1
    assert lanes_per_page([6, 9]) == 3


# ---------------------------------------------------------------------- the KV manager

TINY_FULL = CacheGroupSpec("full", (1,), None, 8, (1, 1))
TINY_SLIDING = CacheGroupSpec("sliding", (0, 2, 3), 8, 24, (1, 1))


def test_admission_counts_the_pages_of_every_group():
    """Pages the window frees in one sequence become another's full-attention blocks."""
    kv = KVCacheManager([TINY_FULL, TINY_SLIDING], SharedPages(24, 1, 1), block_size=4)
    # Alone, a sequence can hold 24 - 4 * 3 = 12 full blocks (a window holds 4 sliding ones).
    assert kv.max_blocks_per_sequence == 12 and kv.num_free_blocks == 24
    a = make_seq(list(range(32)))
    kv.match_prefix(a)
    for _ in range(4):  # chunks of 8: the window keeps at most 4 sliding blocks
        step(kv, a, 8)
    assert kv.stats()["groups"]["sliding"]["in_use"] == 2  # positions 24..31
    # 8 full pages and 2 sliding blocks held; the 3 sliding blocks out of the window are
    # cached (published), their 9 pages reclaimable.
    assert kv.stats()["shared_pages"] == {"total": 24, "free": 1, "cached": 9}
    b = make_seq(list(range(100, 112)))
    kv.match_prefix(b)
    # 3 blocks in each group: 3 + 9 pages, and only 10 are available.
    assert not kv.can_allocate(b, 12)
    assert kv.can_allocate(b, 8) and kv.allocate(b, 8)  # 2 + 6 pages: all three reclaimed
    assert kv.stats()["shared_pages"] == {"total": 24, "free": 2, "cached": 0}
    assert kv.is_exhausted  # no sliding block left
    assert kv.usage == 1.0
    assigned = {block.block_id for block in kv.take_page_assignments()}
    assert {block_id for block_id, _ in kv.tables.layout(b)["sliding"]} <= assigned
    assert kv.take_page_assignments() == []
    check_manager(kv)
    kv.free(a)
    kv.free(b)
    assert_all_released(kv)


def test_a_copy_on_write_of_a_multi_page_block_names_its_pages():
    kv = KVCacheManager([TINY_FULL, TINY_SLIDING], SharedPages(32, 1, 1), block_size=4)
    a = make_seq([1, 2, 3, 4, 5, 6])
    kv.match_prefix(a)
    step(kv, a, 6)
    kv.free(a)  # its prompt's partial block stays in the exact-match index
    kv.take_block_copies()
    b = make_seq([1, 2, 3, 4, 5, 6])
    assert kv.match_prefix(b) == 5
    assert kv.allocate(b, 1)
    copies = {copy.group: copy for copy in kv.take_block_copies()}
    sliding = copies["sliding"]
    assert len(sliding.src_pages) == len(sliding.dst_pages) == 3
    assert sliding.pages == (sliding.src_pages, sliding.dst_pages)
    assert sliding.src == sliding.src_pages[0] and sliding.dst == sliding.dst_pages[0]
    assert copies["full"] == BlockCopy("full", copies["full"].src, copies["full"].dst)
    kv.free(b)
    assert_all_released(kv)


# ---------------------------------------------------------------------- the model runner


def greedy_through_the_manager(
    backend: CustomBackend,
    layout: int | SharedPages,
    prompts: dict[int, list[int]],
    joins: dict[int, dict[int, list[int]]],
    steps: int,
    kv_dtype: torch.dtype | None = None,
) -> dict[int, list[torch.Tensor]]:
    """The engine's loop on the real KV manager and runner (prefix caching on, block size 4,
    a cache in `kv_dtype`, default the model's): every sequence prefills its uncached rest,
    then decodes greedily for `steps` steps; `joins[step]` adds sequences. Returns each
    sequence's logits, step by step."""
    runner = ModelRunner(backend, layout, 4, kv_dtype)
    kv = KVCacheManager(runner.cache_groups, layout, 4)
    running: dict[int, object] = {}
    history: dict[int, list[torch.Tensor]] = {}
    pending = {0: prompts}
    for number in range(steps + max(joins, default=0) + 1):
        for name, tokens in {**pending.pop(number, {}), **joins.get(number, {})}.items():
            seq = make_seq(tokens)
            kv.match_prefix(seq)
            running[name] = seq
        scheduled = []
        for name, seq in list(running.items()):
            if len(history.get(name, [])) > steps:
                kv.free(seq)
                del running[name]
                continue
            count = seq.num_tokens - seq.num_computed_tokens
            assert kv.allocate(seq, count)
            scheduled.append((name, seq, count))
        if not scheduled:
            continue
        out = runner.forward(runner.prepare(plan_of(kv, [(s, n) for _, s, n in scheduled])))
        for row, (name, seq, _) in enumerate(scheduled):
            seq.num_computed_tokens = seq.num_tokens
            history.setdefault(name, []).append(out.logits[row])
            seq.output_token_ids.append(int(out.logits[row].argmax()))
            kv.commit(seq)
    for seq in running.values():
        kv.free(seq)
    assert_all_released(kv)
    return history


@pytest.mark.parametrize(
    "make_config, layouts",
    [
        # 3 sliding layers and 1 full one: pages of 1 layer, sliding blocks of 3.
        (gemma3.mha_config, [SharedPages(48, 1, 32)]),
        # 3 sliding layers and 2 full ones: pages of 2 layers (a sliding block on 2 pages, one
        # lane unused), or of 1 layer (full blocks on 2 pages too).
        (
            gemma3.gqa_config,
            [SharedPages(40, 2, 32), SharedPages(70, 1, 32), SharedPages(40, 1, 64)],
        ),
        # Gemma 4: 2 sliding layers (2 heads of 8) that share a lane, a full layer twice as
        # wide (2 heads of 16) in a lane of its own, the 2 KV-shared layers reading theirs.
        (gemma4.mha_config, [SharedPages(24, 1, 32)]),
        # Gemma 4 with k=v and PLE: sliding layers of 2 heads of 8, full ones of 1 head of 16,
        # as wide and so in lanes of one layer each, pages of 2 lanes.
        (gemma4.full_featured_config, [SharedPages(40, 2, 16)]),
    ],
)
def test_shared_pages_give_the_logits_of_a_pool_per_group(make_config, layouts):
    config = make_config()
    reference = hf_model(config, seed=7)
    backend = CustomBackend(config, reference.state_dict(), CPU, torch.float32, 256)
    first = prompt(10, 1, config.vocab_size)
    prompts = {0: first, 1: first[:8] + prompt(5, 2, config.vocab_size)}  # 8 tokens shared
    joins = {3: {2: first}}  # the same prompt again: cached, its partial block copied on write
    steps = 12
    own = greedy_through_the_manager(backend, 64, prompts, joins, steps)
    assert sorted(own) == [0, 1, 2] and all(len(x) == steps + 1 for x in own.values())
    # Barely more pages than the 3 sequences hold at once: pages the windows free are reused.
    for layout in layouts:
        shared = greedy_through_the_manager(backend, layout, prompts, joins, steps)
        for name in own:
            assert all(torch.equal(x, y) for x, y in zip(shared[name], own[name], strict=True))
    # And transformers agrees (batched with another prefill, the linear layers round a little
    # differently from one sequence alone): float32 rounding through the layers, about 100 ulps
    # of logits near 2 (2.0e-5 at most on an AVX512 CPU without AMX, less on one with it).
    hf_kwargs = gemma3.hf_kwargs(config) if config.model_type == "gemma3_text" else {}
    theirs = hf_greedy(reference, first, steps, **hf_kwargs)
    assert [int(x.argmax()) for x in own[0]] == [int(x.argmax()) for x in theirs]
    assert max((x - y).abs().max().item() for x, y in zip(own[0], theirs, strict=True)) < 5e-5


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler to build the fused kernels")
@pytest.mark.parametrize(
    "make_config, layout",
    [(gemma3.gqa_config, SharedPages(40, 1, 64)), (gemma4.mha_config, SharedPages(24, 1, 32))],
)
def test_the_fused_kernels_read_layers_that_share_a_lane(make_config, layout):
    """Decode attention read in place from the pools (cpu_ops.paged_decode_attention) and
    store_kv, on layers that take part of a lane: the same logits as a pool per group."""
    config = make_config()
    weights = hf_model(config, seed=7).state_dict()
    backend = CustomBackend(config, weights, CPU, torch.float32, 256, kernel="packed")
    assert ModelRunner(backend, layout, 4).paged_decode
    first = prompt(10, 1, config.vocab_size)
    prompts = {0: first, 1: first[:8] + prompt(5, 2, config.vocab_size)}
    own = greedy_through_the_manager(backend, 64, prompts, {3: {2: first}}, 12)
    shared = greedy_through_the_manager(backend, layout, prompts, {3: {2: first}}, 12)
    for name in own:
        assert all(torch.equal(x, y) for x, y in zip(shared[name], own[name], strict=True))
