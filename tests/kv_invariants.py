"""Shared checks and drivers for the KV manager tests: exact bookkeeping invariants and a
minimal stand-in for the engine loop (allocate -> advance -> commit)."""

from __future__ import annotations

from engine.kv.manager import KVCacheManager
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


def check_manager(kv: KVCacheManager) -> None:
    """Every block's ref_count equals the number of block-table entries and session pins
    pointing at it, every page is free or under one live block, and the prefix cache is
    consistent (KVCacheManager.check_integrity)."""
    kv.check_integrity()


def assert_all_released(kv: KVCacheManager) -> None:
    check_manager(kv)
    assert kv.num_free_blocks == kv.pools[kv.primary].num_total
    for pool in kv.pools.values():
        assert pool.num_in_use == 0
        assert pool.num_available == pool.num_total
