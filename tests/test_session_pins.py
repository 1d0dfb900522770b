"""Session pins as pure logic: a finished turn's KV stays held for the session's next turn
against other traffic, and pins yield to quota, idleness, an ended session and memory
pressure, with exact block counts."""

from __future__ import annotations

from engine.kv.layout import CacheGroupSpec
from engine.kv.manager import KVCacheManager
from engine.request import FinishReason, Sequence
from engine.sampling import SamplingParams
from tests.kv_invariants import assert_all_released, check_manager, prefill
from tests.sched_driver import FakeClock, make_scheduler, run_step

BS = 4
FULL = CacheGroupSpec("full", (0,), None, 8)


def turn(tokens: list[int], session: str | None = "s", tenant: str = "t") -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=100), tenant=tenant, kv_session=session)


def finish_turn(kv: KVCacheManager, seq: Sequence, now: float = 0.0) -> None:
    prefill(kv, seq, sampled=99)
    kv.free(seq, pin_at=now)


def test_a_pinned_turn_survives_other_traffic_and_serves_the_next_turn() -> None:
    kv = KVCacheManager([FULL], num_blocks=8, block_size=BS)
    first = turn(list(range(10)))  # 10 prompt tokens + 1 sampled: blocks 0, 1 are full
    finish_turn(kv, first)
    assert kv.pins.pinned_blocks("t") == 2 and kv.stats()["pinned_sessions"] == 1
    # Held, but only by the pin: released on demand, so they count as free.
    assert kv.pools["full"].num_in_use == 2
    assert (kv.num_free_blocks, kv.usage, kv.is_exhausted) == (8, 0.0, False)
    # Other traffic takes every other block and more: the pinned two are never reclaimed.
    for start in (100, 200, 300):
        other = turn(list(range(start, start + 12)), session=None)
        prefill(kv, other)
        kv.free(other)
    assert kv.pools["full"].num_available == 6
    nxt = turn([*first.token_ids, 50, 51, 52])
    assert kv.match_prefix(nxt) == 8  # the whole history, to a block
    check_manager(kv)
    kv.free(nxt)
    assert kv.pins.unpin("t", "s") and not kv.pins.unpin("t", "s")
    assert_all_released(kv)


def test_without_a_pin_the_same_traffic_reclaims_the_history() -> None:
    kv = KVCacheManager([FULL], num_blocks=8, block_size=BS)
    first = turn(list(range(10)), session=None)
    finish_turn(kv, first)
    for start in (100, 200, 300):
        other = turn(list(range(start, start + 12)), session=None)
        prefill(kv, other)
        kv.free(other)
    assert kv.match_prefix(turn([*first.token_ids, 50])) == 0


def test_a_new_turn_moves_the_pin_and_the_old_blocks_stay_held_once() -> None:
    kv = KVCacheManager([FULL], num_blocks=16, block_size=BS)
    first = turn(list(range(10)))
    finish_turn(kv, first)
    second = turn([*first.token_ids, 50, 51, 52, 53, 54])  # 16 tokens + 1 sampled
    finish_turn(kv, second)
    assert kv.pins.pinned_blocks() == 4  # blocks 0-3 of the second turn, 0-1 shared with the first
    assert kv.pools["full"].num_in_use == 4
    check_manager(kv)
    kv.pins.unpin("t", "s")
    assert_all_released(kv)


def test_a_tenants_pins_beyond_its_quota_go_oldest_first() -> None:
    kv = KVCacheManager([FULL], num_blocks=32, block_size=BS, pin_quota_blocks=5)
    for i, session in enumerate(["a", "b", "c"]):
        finish_turn(kv, turn(list(range(100 * i, 100 * i + 8)), session=session), now=i)
    # Each pins 2 blocks: the third pin puts the tenant at 6 > 5, so "a" goes.
    assert not kv.pins.unpin("t", "a") and kv.pins.pinned_blocks("t") == 4
    finish_turn(kv, turn(list(range(900, 908)), session="x", tenant="other"), now=3)
    assert kv.pins.pinned_blocks("other") == 2  # another tenant's quota is its own
    # One session larger than the quota is not kept at all.
    finish_turn(kv, turn(list(range(500, 524)), session="big"), now=4)
    assert not kv.pins.unpin("t", "big")
    assert kv.stats()["released_pins"] == 1 and kv.pins.pinned_blocks("t") == 4


def test_idle_pins_are_released_after_the_idle_time() -> None:
    kv = KVCacheManager([FULL], num_blocks=32, block_size=BS)
    finish_turn(kv, turn(list(range(8)), session="old"), now=10.0)
    finish_turn(kv, turn(list(range(100, 108)), session="new"), now=20.0)
    assert kv.pins.release_idle(before=15.0) == 1
    assert kv.pins.release_idle(before=15.0) == 0
    assert not kv.pins.unpin("t", "old") and kv.pins.unpin("t", "new")
    assert_all_released(kv)


def test_an_aborted_turn_pins_nothing() -> None:
    kv = KVCacheManager([FULL], num_blocks=8, block_size=BS)
    seq = turn(list(range(10)))
    prefill(kv, seq)
    kv.free(seq)  # the scheduler passes no pin time for an abort
    assert kv.pins.pinned_blocks() == 0
    assert_all_released(kv)


def test_the_scheduler_pins_finished_turns_and_releases_pins_before_preempting() -> None:
    clock = FakeClock()
    kv = KVCacheManager([FULL], num_blocks=8, block_size=BS)
    sched = make_scheduler(kv, clock=clock, max_num_batched_tokens=64, session_kv_idle_s=60.0)
    done = turn(list(range(12)))  # 12 + 4 output tokens: 3 full blocks computed
    done.sampling = SamplingParams(max_tokens=4)
    assert sched.add(done).accepted
    while sched.has_work:
        run_step(sched)
    assert done.finish_reason is FinishReason.LENGTH
    assert kv.pins.pinned_blocks("t") == 3
    # A request needing every block: the pin is released rather than refusing or waiting.
    big = turn(list(range(100, 128)), session=None)
    big.sampling = SamplingParams(max_tokens=4)
    assert sched.add(big).accepted
    run_step(sched)
    assert big.num_computed_tokens == 28 and kv.pins.pinned_blocks() == 0
    assert kv.stats()["released_pins"] == 1
    while sched.has_work:
        run_step(sched)
    assert_all_released(kv)


def test_the_scheduler_releases_idle_pins_and_ended_sessions() -> None:
    clock = FakeClock()
    kv = KVCacheManager([FULL], num_blocks=32, block_size=BS)
    sched = make_scheduler(kv, clock=clock, session_kv_idle_s=60.0)
    for session in ("a", "b"):
        seq = turn(list(range(100 * ord(session), 100 * ord(session) + 8)), session=session)
        seq.sampling = SamplingParams(max_tokens=1)
        assert sched.add(seq).accepted
        while sched.has_work:
            run_step(sched)
        clock.now += 30
    assert sched.end_session("t", "b") and kv.pins.pinned_blocks() == 2
    clock.now += 31  # "a" ended its turn 61 s ago
    sched.schedule()
    assert kv.pins.pinned_blocks() == 0
    assert_all_released(kv)
