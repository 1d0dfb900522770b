"""KV pools sized by layer kind (engine.kv.sizing), as pure arithmetic with exact values, and a
KV manager whose groups have pools of different sizes."""

from __future__ import annotations

from engine.kv.layout import CacheGroupSpec
from engine.kv.manager import KVCacheManager
from engine.kv.sizing import blocks_per_group, even_split, sliding_blocks_needed
from tests.kv_invariants import assert_all_released, check_manager, make_seq, step

# Gemma 3 270M in float32: 3 full-attention layers and 15 sliding ones over 512 tokens, one KV
# head of 256 dims, so 2 * 256 * 4 = 2,048 bytes per token per layer.
FULL = CacheGroupSpec("full", (5, 11, 17), None, 3 * 2048)
SLIDING = CacheGroupSpec("sliding", tuple(i for i in range(18) if i % 6 != 5), 512, 15 * 2048)
BUDGET = 65536 * (3 + 15) * 2048  # MAX_ACTIVE_KV_TOKENS=65536 in every layer


def test_even_split_is_the_budget_over_one_block_of_every_group() -> None:
    assert even_split([FULL, SLIDING], BUDGET, 16) == 4096
    assert even_split([FULL, SLIDING], 100, 16) == 1  # never zero


def test_a_sliding_group_needs_a_window_per_sequence_plus_one_step_of_chunks() -> None:
    # 32 window blocks + 2 per sequence, and 512 tokens of chunks in 32 blocks.
    assert sliding_blocks_needed(512, 16, 64, 512) == 64 * 34 + 32 == 2208
    assert sliding_blocks_needed(500, 16, 1, 1) == 32 + 2 + 1


def test_sliding_pools_get_their_windows_and_full_attention_the_rest() -> None:
    sizes = blocks_per_group([FULL, SLIDING], BUDGET, 16, 64, 512)
    assert sizes == {"sliding": 2208, "full": 13536}
    spent = 2208 * 16 * SLIDING.bytes_per_token + 13536 * 16 * FULL.bytes_per_token
    assert spent <= BUDGET < spent + 16 * FULL.bytes_per_token  # all of it, to one block
    # 13,536 full blocks hold 105 sequences of 2,048 tokens; the even split 4,096 blocks, 32.
    assert sizes["full"] * 16 // 2048 == 105 and 4096 * 16 // 2048 == 32


def test_when_windows_for_every_sequence_do_not_fit_the_split_stays_even() -> None:
    # 128 sequences' windows need 4,384 blocks, more than the even split's 4,096: then the full
    # pool would run out first anyway, and sequences shorter than the window fit best evenly.
    assert blocks_per_group([FULL, SLIDING], BUDGET, 16, 128, 512) == {
        "sliding": 4096,
        "full": 4096,
    }


def test_full_attention_is_capped_at_what_sequences_could_ever_hold() -> None:
    sizes = blocks_per_group([FULL, SLIDING], BUDGET, 16, 64, 512, max_context_tokens=40000)
    assert sizes == {"sliding": 2208, "full": 2500}


def test_a_model_without_sliding_layers_gets_one_pool_of_the_whole_budget() -> None:
    assert blocks_per_group([FULL], BUDGET, 16, 64, 512) == {"full": BUDGET // (16 * 6144)}


def test_admission_checks_each_groups_own_pool() -> None:
    """A small sliding pool beside a large full one: a sequence longer than the window keeps
    only its window in the sliding pool, and one that would need more sliding blocks than are
    left does not fit even though the full pool has room."""
    full = CacheGroupSpec("full", (0,), None, 8)
    sliding = CacheGroupSpec("sliding", (1,), 8, 8)
    kv = KVCacheManager([full, sliding], {"full": 32, "sliding": 6}, block_size=4)
    assert (kv.max_blocks_per_sequence, kv.num_free_blocks) == (32, 32)
    a = make_seq(list(range(40)))
    kv.match_prefix(a)
    for _ in range(5):  # in chunks of 8: the window never holds more than 4 sliding blocks
        step(kv, a, 8)
    # 10 full blocks; the window keeps positions 32.. in sliding blocks 8 and 9.
    assert kv.stats()["groups"]["sliding"]["in_use"] == 2
    assert kv.num_free_blocks == 22 and not kv.is_exhausted
    b = make_seq(list(range(100, 120)))
    kv.match_prefix(b)
    assert kv.can_allocate(b, 16)  # 4 blocks each: the sliding pool has 4 of 6 left
    assert not kv.can_allocate(b, 20)  # 5 sliding blocks: only 4 are free
    assert kv.allocate(b, 16)
    assert kv.is_exhausted and kv.num_free_blocks == 18
    assert kv.usage == 1.0  # the sliding pool is the most used
    check_manager(kv)
    kv.free(a)
    kv.free(b)
    assert_all_released(kv)
