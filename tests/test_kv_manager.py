import random

import pytest

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
FULL = CacheGroupSpec("full", (0, 2), None, 64)
SLIDING = CacheGroupSpec("sliding", (1,), 8, 32)


def logical(kv, seq, group="full"):
    return [index for _, index in kv.tables.layout(seq)[group]]


def test_fresh_sequence_layout_slots_and_keys():
    kv = KVCacheManager([FULL], num_blocks=8, block_size=BS)
    seq = make_seq(list(range(10)))
    assert kv.match_prefix(seq) == 0
    assert kv.tables.blocks_needed(seq, 10) == 3 and kv.can_allocate(seq, 10)
    assert kv.allocate(seq, 10)
    assert kv.tables.layout(seq) == {"full": [(0, 0), (1, 1), (2, 2)]}
    assert kv.tables.slots_for_new_tokens(seq, 10) == {"full": list(range(10))}
    assert attended_keys(kv, seq, 10) == {"full": (list(range(10)), list(range(10)))}
    assert (kv.num_free_blocks, kv.max_blocks_per_sequence, kv.usage) == (5, 8, 3 / 8)
    seq.num_computed_tokens = 10
    seq.output_token_ids.append(5)
    kv.commit(seq)
    assert kv.tables.blocks_needed(seq, 1) == 0  # position 10 is in block 2
    assert kv.allocate(seq, 1) and kv.tables.slots_for_new_tokens(seq, 1) == {"full": [10]}
    kv.free(seq)
    kv.free(seq)  # idempotent
    assert kv.tables.layout(seq) == {"full": []}
    assert_all_released(kv)


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager([FULL, SLIDING], num_blocks=4, block_size=BS)
    a = make_seq(list(range(12)))
    kv.match_prefix(a)
    assert kv.allocate(a, 12)
    b = make_seq(list(range(50, 58)))
    kv.match_prefix(b)
    assert kv.tables.blocks_needed(b, 8) == 2 and not kv.can_allocate(b, 8)
    assert not kv.allocate(b, 8)
    assert kv.tables.layout(b) == {"full": [], "sliding": []}
    assert kv.num_free_blocks == 1
    assert kv.allocate(b, 4)
    assert kv.num_free_blocks == 0
    assert kv.allocate(b, 0)  # nothing to add
    check_manager(kv)
    kv.free(a)
    kv.free(b)
    assert_all_released(kv)


def test_sliding_group_frees_blocks_out_of_the_window():
    kv = KVCacheManager([FULL, SLIDING], num_blocks=32, block_size=BS)
    seq = make_seq(list(range(20)))
    prefill(kv, seq)
    # Window 8 at 20 computed tokens: keys from position 12 on are kept, blocks 0..2 go.
    assert logical(kv, seq, "full") == [0, 1, 2, 3, 4]
    assert kv.tables.layout(seq)["sliding"] == [(3, 3), (4, 4)]
    groups = kv.stats()["groups"]
    assert groups["sliding"] == {
        "total": 32,
        "pages_per_block": 1,
        "in_use": 2,
        "cached_unused": 3,
        "free": 27,
        "reclaimed": 0,
    }
    assert groups["full"]["in_use"] == 5 and kv.num_free_blocks == 27
    assert kv.allocate(seq, 1)
    window = list(range(12, 21))
    assert attended_keys(kv, seq, 1)["sliding"] == (window, window)
    kv.take_block_copies()
    seq.num_computed_tokens += 1
    seq.output_token_ids.append(1)
    kv.commit(seq)
    assert logical(kv, seq, "sliding") == [3, 4, 5]
    decode(kv, seq, [2, 3, 4])  # 24 computed: keys from 16 on
    assert logical(kv, seq, "sliding") == [4, 5]
    assert kv.stats()["window_freed_blocks"] == 4

    # A prefix match takes only the sliding blocks the window still needs.
    other = make_seq([*seq.token_ids[:20], 900, 901, 902])
    assert kv.match_prefix(other) == 20
    assert logical(kv, other, "full") == [0, 1, 2, 3, 4]
    assert kv.tables.layout(other)["sliding"] == [(3, 3), (4, 4)]
    assert kv.allocate(other, 3) and kv.take_block_copies() == []
    assert kv.tables.layout(other)["sliding"] == [(3, 3), (4, 4), (6, 5)]
    check_manager(kv)
    kv.free(seq)
    kv.free(other)
    assert_all_released(kv)


def test_sliding_group_without_prefix_caching_returns_blocks_to_the_free_queue():
    kv = KVCacheManager([FULL, SLIDING], num_blocks=8, block_size=BS, enable_prefix_caching=False)
    seq = make_seq(list(range(20)))
    prefill(kv, seq)
    sliding = kv.stats()["groups"]["sliding"]
    assert sliding == {
        "total": 8,
        "pages_per_block": 1,
        "in_use": 2,
        "cached_unused": 0,
        "free": 6,
        "reclaimed": 0,
    }
    kv.free(seq)
    assert_all_released(kv)


def test_preempted_sequence_recomputes_only_past_its_cached_blocks():
    kv = KVCacheManager([FULL], num_blocks=8, block_size=BS)
    seq = make_seq(list(range(10)))
    prefill(kv, seq, sampled=20)
    decode(kv, seq, [21, 22, 23])
    assert (seq.num_computed_tokens, seq.num_tokens) == (13, 14)
    kv.free(seq)  # preemption: the scheduler resets the progress
    seq.num_computed_tokens = 0
    seq.num_preemptions += 1
    assert kv.match_prefix(seq) == 12
    assert seq.num_cached_prompt_tokens == 10
    assert kv.tables.blocks_needed(seq, 2) == 1
    step(kv, seq, 2, sampled=24)
    assert logical(kv, seq) == [0, 1, 2, 3] and kv.take_block_copies() == []
    kv.free(seq)
    assert_all_released(kv)


def test_a_repeated_match_releases_the_earlier_references():
    kv = KVCacheManager([FULL], num_blocks=8, block_size=BS)
    a = make_seq(list(range(9)))
    prefill(kv, a)
    kv.free(a)
    b = make_seq(list(range(9)))
    assert kv.match_prefix(b) == 8
    assert kv.match_prefix(b) == 8  # e.g. allocate failed and the scheduler tries again
    assert kv.pools["full"].live[0].ref_count == 1
    kv.free(b)
    assert_all_released(kv)


def test_no_leaks_after_finish_abort_preemption_and_eviction():
    kv = KVCacheManager([FULL, SLIDING], num_blocks=40, block_size=BS)
    start = kv.num_free_blocks
    finished = make_seq(list(range(30)))
    prefill(kv, finished)
    decode(kv, finished, [1, 2, 3])
    kv.free(finished)

    aborted_in_prefill = make_seq(list(range(40)))
    kv.match_prefix(aborted_in_prefill)
    step(kv, aborted_in_prefill, 16)  # first chunk computed
    assert kv.allocate(aborted_in_prefill, 16)  # second chunk scheduled, then the client left
    kv.free(aborted_in_prefill)

    aborted_in_decode = make_seq([*range(30), 7, 7])
    assert prefill(kv, aborted_in_decode) == 28  # shares finished's blocks
    decode(kv, aborted_in_decode, [4])
    assert kv.allocate(aborted_in_decode, 1)
    kv.free(aborted_in_decode)

    preempted = make_seq(list(range(100, 130)), eviction_policy="sink", max_kv_tokens=12)
    prefill(kv, preempted)
    decode(kv, preempted, [5, 6, 7, 8, 9])
    assert logical(kv, preempted) == [0, 7, 8]
    kv.free(preempted)
    preempted.num_computed_tokens = 0
    assert kv.match_prefix(preempted) == 28  # blocks published before the first eviction
    step(kv, preempted, preempted.num_tokens - 28)
    kv.free(preempted)

    check_manager(kv)
    assert kv.num_free_blocks == start
    assert_all_released(kv)
    assert kv.take_block_copies() == []  # every match above ended on a block boundary


# ----------------------------------------------------------------------------- stress


class SimulatedCache:
    """Stands in for the backend's K/V memory: each slot holds a fingerprint of the context
    that produced it, so a wrong share, a missed copy or a reused live block shows up."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.memory = {g: {} for g in kv.pools}
        self.expected: dict[int, dict[int, object]] = {}

    def fingerprint(self, seq, position):
        state = self.kv.tables.seqs.get(seq.seq_id)
        if state is not None and state.first_evicted is not None:
            return ("computed without evicted context", seq.seq_id, position)
        return hash((seq.cache_salt, tuple(seq.token_ids[: position + 1])))

    def matched(self, seq, cached):
        self.expected[seq.seq_id] = {p: self.fingerprint(seq, p) for p in range(cached)}

    def copy(self, copies):
        for c in copies:
            memory = self.memory[c.group]
            for offset in range(BS):
                value = memory.get(c.src * BS + offset)
                if value is None:
                    memory.pop(c.dst * BS + offset, None)
                else:
                    memory[c.dst * BS + offset] = value

    def write(self, seq, num_new):
        for group, slots in self.kv.tables.slots_for_new_tokens(seq, num_new).items():
            for i, slot in enumerate(slots):
                position = seq.num_computed_tokens + i
                self.memory[group][slot] = self.fingerprint(seq, position)
                self.expected[seq.seq_id][position] = self.fingerprint(seq, position)

    def attend(self, seq, num_new):
        end = seq.num_computed_tokens + num_new
        keys = attended_keys(self.kv, seq, num_new)
        for group, (slots, positions) in keys.items():
            for slot, position in zip(slots, positions, strict=True):
                expected = self.expected[seq.seq_id][position]
                assert self.memory[group].get(slot) == expected, (group, position)
        full_positions = set(keys["full"][1])
        if seq.eviction_policy == "none":
            assert keys["full"][1] == list(range(end))
        if "sliding" in keys:
            in_window = {p for p in full_positions if p >= end - SLIDING.sliding_window}
            assert in_window <= set(keys["sliding"][1])
        return keys["full"][0]


def run_stress(seed: int, groups, num_blocks: int, caching: bool, rounds: int = 300):
    rng = random.Random(seed)
    kv = KVCacheManager(groups, num_blocks, BS, enable_prefix_caching=caching)
    sim = SimulatedCache(kv)
    prefixes = [[rng.randrange(6) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    waiting, running = [], []
    budget_left = {}

    def new_seq():
        tokens = list(rng.choice(prefixes))
        if rng.random() < 0.6:
            tokens += [rng.randrange(6) for _ in range(rng.randrange(0, 10))]
        policy = rng.choice(["none", "none", "lru", "sink", "h2o"])
        seq = make_seq(
            tokens,
            cache_salt=rng.choice([None, None, "tenant-b"]),
            eviction_policy=policy,
            max_kv_tokens=rng.choice([8, 12, 16]) if policy != "none" else None,
        )
        budget_left[seq.seq_id] = rng.randrange(1, 16)
        return seq

    def chunk(seq):
        remaining = seq.num_tokens - seq.num_computed_tokens
        return remaining if remaining == 1 else min(rng.randrange(1, 13), remaining)

    for _ in range(rounds):
        if rng.random() < 0.5 and len(waiting) + len(running) < 7:
            waiting.append(new_seq())
        batch = []
        for seq in list(running):
            num_new = chunk(seq)
            if kv.allocate(seq, num_new):
                batch.append((seq, num_new))
            else:  # preempt: recompute later
                kv.free(seq)
                seq.num_computed_tokens = 0
                running.remove(seq)
                waiting.append(seq)
        for seq in list(waiting):
            if seq in (s for s, _ in batch):
                continue
            sim.matched(seq, kv.match_prefix(seq))
            num_new = chunk(seq)
            if kv.allocate(seq, num_new):
                waiting.remove(seq)
                running.append(seq)
                batch.append((seq, num_new))
            else:
                kv.free(seq)
                seq.num_computed_tokens = 0
        sim.copy(kv.take_block_copies())
        for seq, num_new in batch:
            sim.write(seq, num_new)
        for seq, num_new in batch:
            slots = sim.attend(seq, num_new)
            if kv.wants_attention(seq):
                kv.record_attention(seq, KeyMass(slots, [rng.random() for _ in slots]))
        for seq, num_new in batch:
            seq.num_computed_tokens += num_new
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(rng.randrange(6))
            kv.commit(seq)
            if seq.num_output_tokens >= budget_left[seq.seq_id] or rng.random() < 0.03:
                kv.free(seq)
                running.remove(seq)
        check_manager(kv)
    for seq in running + waiting:
        kv.free(seq)
    assert_all_released(kv)
    return kv


@pytest.mark.parametrize("seed", range(4))
def test_stress_full_and_sliding_with_prefix_caching(seed):
    kv = run_stress(seed, [FULL, SLIDING], num_blocks=24, caching=True)
    stats = kv.stats()
    assert stats["prefix_cache"]["hit_tokens"] > 0
    assert stats["groups"]["full"]["reclaimed"] > 0


@pytest.mark.parametrize("seed", range(2))
def test_stress_full_only_and_without_prefix_caching(seed):
    run_stress(seed, [FULL], num_blocks=20, caching=True)
    run_stress(seed, [FULL, SLIDING], num_blocks=20, caching=False)
