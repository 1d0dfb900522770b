import pytest
import torch

from engine.kv.eviction import H2OEviction, LRUEviction, NoEviction, SinkEviction, make_policy
from engine.kv.layout import CacheGroupSpec
from engine.kv.manager import KVCacheManager
from engine.kv.session_eviction import KeyMass
from tests.kv_invariants import (
    assert_all_released,
    attended_keys,
    check_manager,
    decode,
    make_seq,
    prefill,
    step,
)

BS = 4
FULL = CacheGroupSpec("full", (0,), None, 64)
HELD = list(range(10))


def test_none_keeps_everything():
    assert NoEviction().select_victims(HELD, 4, {}) == []


def test_lru_drops_the_oldest_blocks():
    assert LRUEviction().select_victims(HELD, 4, {}) == [0, 1, 2, 3, 4, 5]
    assert LRUEviction().select_victims([3, 4], 4, {}) == []


def test_sink_keeps_the_first_blocks_and_a_recent_window():
    one_sink = SinkEviction(sink_tokens=4, block_size=BS)
    assert (one_sink.sink_blocks, one_sink.min_blocks) == (1, 2)
    assert one_sink.select_victims(HELD, 4, {}) == [1, 2, 3, 4, 5, 6]  # keeps 0, 7, 8, 9
    assert one_sink.select_victims([0, 7, 8, 9, 10], 4, {}) == [7]  # after an earlier eviction
    two_sinks = SinkEviction(sink_tokens=5, block_size=BS)
    assert two_sinks.select_victims(HELD, 4, {}) == [2, 3, 4, 5, 6, 7]  # keeps 0, 1, 8, 9


def test_h2o_keeps_heavy_hitters_and_a_recent_window():
    h2o = H2OEviction(recent_fraction=0.5)
    scores = {0: 5.0, 3: 9.0, 5: 1.0, 6: 5.0, 8: 100.0}
    # Recent: 8, 9. Heavy among 0..7: block 3 (9.0), then 0 over 6 (tie at 5.0: earlier wins).
    assert h2o.select_victims(HELD, 4, scores) == [1, 2, 4, 5, 6, 7]
    # budget 5: recent = ceil(2.5) = 3 blocks (7, 8, 9), heavy = 2.
    assert h2o.select_victims(HELD, 5, scores) == [1, 2, 4, 5, 6]
    assert H2OEviction(recent_fraction=1.0).select_victims(HELD, 4, scores) == [0, 1, 2, 3, 4, 5]


def test_make_policy_names():
    names = ["none", "lru", "sink", "h2o"]
    assert [make_policy(name, BS).name for name in names] == names
    with pytest.raises(ValueError):
        make_policy("fifo", BS)
    with pytest.raises(ValueError):
        H2OEviction(recent_fraction=0.0)


def test_lru_session_keeps_generating_with_bounded_memory():
    kv = KVCacheManager([FULL], num_blocks=16, block_size=BS)
    other = make_seq(list(range(100, 108)))
    prefill(kv, other)  # occupies physical blocks 0 and 1, so physical != logical below
    seq = make_seq(list(range(6)), eviction_policy="lru", max_kv_tokens=8)
    prefill(kv, seq)
    assert kv.tables.layout(seq)["full"] == [(2, 0), (3, 1)]
    decode(kv, seq, [10, 11, 12, 13, 14, 15, 16])
    assert seq.num_computed_tokens == 13
    # Oldest blocks dropped; kept keys keep their original positions.
    assert kv.tables.layout(seq)["full"] == [(4, 2), (5, 3)]
    assert attended_keys(kv, seq, 1)["full"] == (
        [16, 17, 18, 19, 20, 21],
        [8, 9, 10, 11, 12, 13],
    )
    assert kv.tables.num_held(seq, "full") == 2
    assert kv.stats()["evicted_blocks"] == 2
    # Blocks 0 and 1 were published before the first eviction; nothing after it is.
    assert kv.cache.num_nodes == 2 + 2
    check_manager(kv)
    kv.free(seq)
    kv.free(other)
    assert_all_released(kv)


def test_sink_during_chunked_prefill():
    kv = KVCacheManager([FULL], num_blocks=16, block_size=BS)
    seq = make_seq(list(range(20)), eviction_policy="sink", max_kv_tokens=12)
    assert kv.match_prefix(seq) == 0
    held_after_each_chunk = []
    for _ in range(5):
        step(kv, seq, 4)
        held_after_each_chunk.append([logical for _, logical in kv.tables.layout(seq)["full"]])
    assert held_after_each_chunk == [[0], [0, 1], [0, 1, 2], [0, 2, 3], [0, 3, 4]]
    assert kv.cache.num_nodes == 4  # blocks 0..3 were published before block 1 was dropped
    assert kv.cache.num_exact_entries == 0  # the prompt's KV is incomplete: not indexed
    kv.free(seq)
    assert_all_released(kv)


def test_budget_below_the_policy_minimum_is_raised():
    kv = KVCacheManager([FULL], num_blocks=16, block_size=BS)
    seq = make_seq(list(range(20)), eviction_policy="sink", max_kv_tokens=4)
    prefill(kv, seq)
    assert [logical for _, logical in kv.tables.layout(seq)["full"]] == [0, 4]  # sink + 1 recent
    kv.free(seq)
    assert_all_released(kv)


def test_h2o_keeps_the_block_that_received_the_most_attention():
    kv = KVCacheManager([FULL], num_blocks=16, block_size=BS)
    seq = make_seq(list(range(12)), eviction_policy="h2o", max_kv_tokens=12)
    assert kv.wants_attention(seq)
    assert not kv.wants_attention(make_seq([1], eviction_policy="lru", max_kv_tokens=12))
    prefill(kv, seq)

    def decode_with_attention(heavy_block: int) -> None:
        assert kv.allocate(seq, 1)
        slots, positions = attended_keys(kv, seq, 1)["full"]
        mass = torch.tensor([1.0 if p // BS == heavy_block else 0.1 for p in positions])
        kv.record_attention(seq, KeyMass(torch.tensor(slots), mass))
        seq.num_computed_tokens += 1
        seq.output_token_ids.append(0)
        kv.commit(seq)

    decode_with_attention(heavy_block=1)  # position 12 opens block 3: 4 blocks > 3
    # Recent window: blocks 2, 3; among 0 and 1, block 1 got the attention.
    assert [logical for _, logical in kv.tables.layout(seq)["full"]] == [1, 2, 3]
    assert kv.tables.seqs[seq.seq_id].scores == pytest.approx({1: 4.0, 2: 0.4, 3: 0.1})
    for _ in range(4):  # positions 13..16: block 4 opens
        decode_with_attention(heavy_block=1)
    assert [logical for _, logical in kv.tables.layout(seq)["full"]] == [1, 3, 4]
    kv.free(seq)
    assert_all_released(kv)


def test_no_budget_means_no_eviction_and_unknown_policies_fail_loudly():
    kv = KVCacheManager([FULL], num_blocks=16, block_size=BS)
    unbounded = make_seq(list(range(20)), eviction_policy="lru")
    prefill(kv, unbounded)
    assert kv.tables.num_held(unbounded, "full") == 5
    bad = make_seq(list(range(8)), eviction_policy="fifo", max_kv_tokens=4)
    kv.match_prefix(bad)
    assert kv.allocate(bad, 8)
    bad.num_computed_tokens = 8
    with pytest.raises(ValueError, match="fifo"):
        kv.commit(bad)
