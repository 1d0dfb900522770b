"""A session with an eviction policy keeps its evicted cache across turns (StreamingLLM): each
turn adopts the last turn's block state with its holes and prefills only its new tokens, so an
unbounded conversation runs in bounded memory. Pure logic, exact block counts."""

from __future__ import annotations

from math import ceil

from engine.kv.layout import CacheGroupSpec
from engine.kv.manager import KVCacheManager
from engine.kv.session_eviction import KeyMass
from engine.request import Sequence
from engine.sampling import SamplingParams
from tests.kv_invariants import assert_all_released, attended_keys, check_manager, decode, step
from tests.sched_driver import FakeClock, make_scheduler, run_step

BS = 4
FULL = CacheGroupSpec("full", (0,), None, 8)
SLIDING = CacheGroupSpec("sliding", (1,), 8, 8)
BUDGET_TOKENS = 16  # 4 blocks; sink keeps block 0 and the 3 most recent
BUDGET = BUDGET_TOKENS // BS
CHUNK = 8  # prefill tokens per step


def turn(tokens: list[int], policy: str = "sink", **kwargs) -> Sequence:
    sampling = SamplingParams(max_tokens=100)
    return Sequence(
        list(tokens),
        sampling,
        tenant="t",
        kv_session="s",
        eviction_policy=policy,
        max_kv_tokens=BUDGET_TOKENS,
        **kwargs,
    )


def test_ten_turns_prefill_only_their_new_tokens_in_bounded_memory() -> None:
    kv = KVCacheManager([FULL], num_blocks=64, block_size=BS)
    history: list[int] = list(range(24))  # more than the budget: turn 1 evicts
    previous: Sequence | None = None
    for number in range(10):
        seq = turn([*history, *range(100 * number, 100 * number + 12)] if number else history)
        cached = kv.match_prefix(seq)
        if previous is None:
            assert cached == 0
        else:
            # Everything the last turn computed; only its last sampled token and the new
            # message are prefilled.
            assert cached == previous.num_tokens - 1 == seq.num_cached_prompt_tokens
            assert seq.num_tokens - cached == 1 + 12
            assert kv.stats()["resumed_kept"] == number
        while seq.num_output_tokens == 0:  # chunked prefill, then the first sample
            num_new = min(CHUNK, seq.num_tokens - seq.num_computed_tokens)
            before = seq.num_computed_tokens
            assert kv.allocate(seq, num_new)
            # Held: at most the budget plus the blocks of one step's chunk.
            assert kv.tables.num_held(seq, "full") <= BUDGET + ceil(num_new / BS)
            assert kv.pools["full"].num_in_use == kv.tables.num_held(seq, "full")
            seq.num_computed_tokens = before + num_new
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(50 + number)
            kv.commit(seq)
            assert kv.tables.num_held(seq, "full") <= BUDGET
        decode(kv, seq, [60 + number, 70 + number])
        check_manager(kv)
        kv.free(seq, pin_at=float(number))
        stats = kv.stats()
        assert (stats["pinned_sessions"], stats["kept_sessions"]) == (1, 1)
        # Between turns the session holds exactly its kept state, and it counts as free.
        assert kv.pins.pinned_blocks("t") == kv.pools["full"].num_in_use == BUDGET
        assert kv.num_free_blocks == kv.max_blocks_per_sequence
        check_manager(kv)
        history, previous = seq.token_ids, seq
    assert len(history) > 8 * BUDGET_TOKENS
    assert kv.pins.unpin("t", "s")
    assert_all_released(kv)


def first_turn(kv: KVCacheManager, policy: str = "sink") -> Sequence:
    seq = turn(list(range(24)), policy)
    kv.match_prefix(seq)
    for _ in range(3):
        step(kv, seq, CHUNK, sampled=50)
    decode(kv, seq, [51, 52])
    kv.free(seq, pin_at=0.0)
    assert kv.stats()["kept_sessions"] == 1
    return seq


def test_an_adopted_state_keeps_every_position() -> None:
    kv = KVCacheManager([FULL, SLIDING], num_blocks=64, block_size=BS)
    first = first_turn(kv)  # 27 tokens, 26 computed: blocks 0, 4, 5, 6 held
    second = turn([*first.token_ids, 80, 81, 82])
    assert kv.match_prefix(second) == 26
    assert [index for _, index in kv.tables.layout(second)["full"]] == [0, 4, 5, 6]
    assert [index for _, index in kv.tables.layout(second)["sliding"]] == [4, 5, 6]  # window of 8
    assert kv.allocate(second, 4)
    slots, positions = attended_keys(kv, second, 4)["full"]
    assert positions == [0, 1, 2, 3, *range(16, 30)]  # original positions, new ones after
    assert len(slots) == len(set(slots))
    sliding = attended_keys(kv, second, 4)["sliding"][1]
    assert sliding == list(range(16, 30))
    second.num_computed_tokens = 30
    second.output_token_ids.append(90)
    kv.commit(second)
    assert [index for _, index in kv.tables.layout(second)["full"]] == [0, 5, 6, 7]
    assert [index for _, index in kv.tables.layout(second)["sliding"]] == [5, 6, 7]
    check_manager(kv)
    kv.free(second)
    kv.pins.unpin("t", "s")
    assert_all_released(kv)


def test_h2o_scores_travel_with_the_kept_state() -> None:
    kv = KVCacheManager([FULL], num_blocks=64, block_size=BS)
    seq = turn(list(range(24)), "h2o")
    kv.match_prefix(seq)
    step(kv, seq, 16, sampled=50)
    block_1 = kv.tables.layout(seq)["full"][1][0]
    kv.record_attention(seq, KeyMass([block_1 * BS], [5.0]))  # logical block 1 is a heavy hitter
    step(kv, seq, 8, sampled=50)
    kv.free(seq, pin_at=0.0)
    second = turn([*seq.token_ids, 80], "h2o")
    assert kv.match_prefix(second) == 24
    assert 1 in [index for _, index in kv.tables.layout(second)["full"]]
    assert kv.tables.seqs[second.seq_id].scores[1] == 5.0
    kv.free(second)
    assert_all_released(kv)


def test_a_diverging_turn_releases_the_kept_state_and_matches_the_prefix_cache() -> None:
    kv = KVCacheManager([FULL], num_blocks=64, block_size=BS)
    first = first_turn(kv)
    edited = turn([*first.token_ids[:20], 999, 998])  # the history was edited at token 20
    # Blocks 0-5 were published before the step's eviction and are still cached.
    assert kv.match_prefix(edited) == 20
    assert kv.stats()["kept_sessions"] == 0 and kv.pins.pinned_blocks() == 0
    check_manager(kv)
    kv.free(edited)
    assert_all_released(kv)


def test_a_turn_without_the_same_policy_does_not_adopt() -> None:
    for policy, salt in (("none", None), ("lru", None), ("sink", "other")):
        kv = KVCacheManager([FULL], num_blocks=64, block_size=BS)
        first = first_turn(kv)
        seq = turn([*first.token_ids, 80], policy, cache_salt=salt)
        assert kv.match_prefix(seq) == (24 if salt is None else 0)
        assert kv.stats()["kept_sessions"] == 0
        kv.free(seq)
        assert_all_released(kv)


def test_a_kept_state_yields_like_any_pin() -> None:
    kv = KVCacheManager([FULL], num_blocks=64, block_size=BS, pin_quota_blocks=BUDGET)
    first_turn(kv)
    assert kv.pins.pinned_blocks("t") == BUDGET and kv.num_free_blocks == kv.max_blocks_per_sequence
    assert kv.pins.release_oldest() and kv.stats()["released_pins"] == 1
    assert_all_released(kv)
    kv = KVCacheManager([FULL], num_blocks=64, block_size=BS)
    first_turn(kv)
    assert kv.pins.release_idle(before=1.0) == 1
    assert_all_released(kv)
    kv = KVCacheManager([FULL], num_blocks=64, block_size=BS, pin_quota_blocks=BUDGET - 1)
    seq = turn(list(range(24)))
    kv.match_prefix(seq)
    step(kv, seq, 24, sampled=50)
    kv.free(seq, pin_at=0.0)  # the kept state is larger than the quota: not kept
    assert kv.pins.pinned_blocks() == 0
    assert_all_released(kv)


def test_an_aborted_adopted_turn_keeps_nothing() -> None:
    kv = KVCacheManager([FULL], num_blocks=64, block_size=BS)
    first = first_turn(kv)
    second = turn([*first.token_ids, 80, 81])
    kv.match_prefix(second)
    step(kv, second, 3, sampled=50)
    kv.free(second)  # aborted: no pin time
    assert kv.pins.pinned_blocks() == 0
    assert_all_released(kv)


def test_the_scheduler_reports_adopted_tokens_as_cached_and_does_not_charge_them() -> None:
    kv = KVCacheManager([FULL], num_blocks=64, block_size=BS)
    sched = make_scheduler(kv, clock=FakeClock(), max_num_batched_tokens=CHUNK)
    history: list[int] = list(range(24))
    for number in range(4):
        seq = turn([*history, 100 + number, 101 + number])
        seq.sampling = SamplingParams(max_tokens=3)
        assert sched.add(seq).accepted
        charged_before = sched.ledger.tenants["t"].prompt_tokens if number else 0
        while sched.has_work:
            run_step(sched)
        if number:
            assert seq.num_cached_prompt_tokens == len(history) - 1
            assert sched.ledger.tenants["t"].prompt_tokens - charged_before == 1 + 2
        assert kv.pins.pinned_blocks("t") <= BUDGET
        history = seq.token_ids
    assert sched.end_session("t", "s")
    assert_all_released(kv)
