"""Continuous batching, chunked prefill, preemption, abort and admission, with exact traces."""

from __future__ import annotations

import pytest

from engine.request import FinishReason, SequenceStatus
from engine.sched import AdmissionStatus, StepResult
from engine.sched.admission import CompletionRate, kv_tokens_needed
from tests.sched_driver import FakeClock, make_kv, make_scheduler, make_seq, plan, run_step


def run_until_idle(sched, max_steps: int = 1000) -> int:
    steps = 0
    while sched.has_work:
        run_step(sched)
        steps += 1
        assert steps <= max_steps, "the scheduler stopped making progress"
    return steps


# ---------------------------------------------------------------- batching and chunked prefill


def test_long_prompt_is_chunked_under_the_token_budget_and_decodes_go_first():
    sched = make_scheduler(policy="fcfs", max_num_batched_tokens=8, max_num_seqs=4)
    a = make_seq(3, max_tokens=5)
    assert sched.add(a).accepted
    assert plan(run_step(sched)) == [(a.seq_id, 0, 3, True)]

    b = make_seq(20, max_tokens=2)
    assert sched.add(b).accepted
    # a keeps decoding every step while b's 20-token prompt goes through in 7+7+6 chunks.
    assert plan(run_step(sched)) == [(a.seq_id, 3, 1, True), (b.seq_id, 0, 7, False)]
    assert plan(run_step(sched)) == [(a.seq_id, 4, 1, True), (b.seq_id, 7, 7, False)]
    assert plan(run_step(sched)) == [(a.seq_id, 5, 1, True), (b.seq_id, 14, 6, True)]
    out = run_step(sched)
    assert plan(out) == [(a.seq_id, 6, 1, True), (b.seq_id, 20, 1, True)]
    assert out.num_batched_tokens == 2
    assert (a.num_output_tokens, b.num_output_tokens) == (5, 2)
    assert a.finish_reason is FinishReason.LENGTH and b.finish_reason is FinishReason.LENGTH
    last = sched.schedule()
    assert last.is_empty and last.finished == [a.seq_id, b.seq_id]
    assert not sched.has_work


def test_a_seeded_prompt_computes_its_last_token_in_a_step_of_its_own():
    """Cold, a seeded prompt's last token runs alone as a cached prompt's does (one row over
    the KV before it), so its first token is sampled from the same logits both times."""
    sched = make_scheduler(policy="fcfs", max_num_batched_tokens=8, max_num_seqs=4)
    seeded = make_seq(5, max_tokens=2, seed=7)
    plain = make_seq(5, max_tokens=2)
    sched.add(seeded)
    sched.add(plain)
    # The budget takes 4 of seeded's 5 tokens, then 4 of plain's, which finishes next step.
    assert plan(run_step(sched)) == [(seeded.seq_id, 0, 4, False), (plain.seq_id, 0, 4, False)]
    assert plan(run_step(sched)) == [(seeded.seq_id, 4, 1, True), (plain.seq_id, 4, 1, True)]

    chunked = make_seq(12, max_tokens=1, seed=7)
    sched.add(chunked)
    run_step(sched)  # the others decode and finish; chunked takes the 6 budget tokens left
    # Over the budget, only the chunk that would end the prompt gives up its last token.
    assert plan(run_step(sched)) == [(chunked.seq_id, 6, 5, False)]
    assert plan(run_step(sched)) == [(chunked.seq_id, 11, 1, True)]


def test_num_computed_tokens_advances_in_update_not_in_schedule():
    kv = make_kv()
    sched = make_scheduler(kv, policy="fcfs", max_num_batched_tokens=4)
    a = make_seq(6, max_tokens=2)
    sched.add(a)
    out = sched.schedule()
    assert plan(out) == [(a.seq_id, 0, 4, False)]
    # During the step the KV manager still addresses from the old position.
    assert a.num_computed_tokens == 0
    block = kv.tables.layout(a)["full"][0][0]
    assert kv.tables.slots_for_new_tokens(a, 4)["full"] == [block * 4 + i for i in range(4)]
    sched.update(out, StepResult())
    assert a.num_computed_tokens == 4 and a.num_output_tokens == 0


def test_max_num_seqs_bounds_a_step_and_freed_capacity_is_refilled_at_once():
    sched = make_scheduler(policy="fcfs", max_num_seqs=2)
    a, b, c = make_seq(2, max_tokens=1), make_seq(2, max_tokens=3), make_seq(2, max_tokens=1)
    for seq in (a, b, c):
        sched.add(seq)
    assert plan(run_step(sched)) == [(a.seq_id, 0, 2, True), (b.seq_id, 0, 2, True)]
    assert a.is_finished and sched.num_waiting == 1
    # a's slot goes to c in the very next step, next to b's decode.
    assert plan(run_step(sched)) == [(b.seq_id, 2, 1, True), (c.seq_id, 0, 2, True)]


def test_a_burst_of_prompts_is_prefilled_a_group_at_a_time():
    """No further prompt joins a step whose prefill chunks hold prefill_group_tokens: the
    first two of four 6-token prompts (12 >= 10) get their first token a step before the
    others, who then join the first two's decodes."""
    sched = make_scheduler(
        policy="fcfs", max_num_batched_tokens=32, prefill_group_tokens=10, max_num_seqs=8
    )
    a, b, c, d = (make_seq(6, max_tokens=3) for _ in range(4))
    for seq in (a, b, c, d):
        sched.add(seq)
    assert plan(run_step(sched)) == [(a.seq_id, 0, 6, True), (b.seq_id, 0, 6, True)]
    assert plan(run_step(sched)) == [
        (a.seq_id, 6, 1, True),
        (b.seq_id, 6, 1, True),
        (c.seq_id, 0, 6, True),
        (d.seq_id, 0, 6, True),
    ]


def test_the_first_prompt_of_a_step_may_take_the_whole_budget_past_the_group():
    """The group limits who joins a step, not a prompt's chunk: a 30-token prompt goes in one
    chunk of the 32-token budget, and the prompt behind it waits for the next step."""
    sched = make_scheduler(
        policy="fcfs", max_num_batched_tokens=32, prefill_group_tokens=10, max_num_seqs=8
    )
    a, b = make_seq(30, max_tokens=2), make_seq(4, max_tokens=2)
    sched.add(a)
    sched.add(b)
    assert plan(run_step(sched)) == [(a.seq_id, 0, 30, True)]
    assert plan(run_step(sched)) == [(a.seq_id, 30, 1, True), (b.seq_id, 0, 4, True)]


def test_without_a_prefill_group_the_budget_alone_decides():
    sched = make_scheduler(
        policy="fcfs", max_num_batched_tokens=32, prefill_group_tokens=None, max_num_seqs=8
    )
    seqs = [make_seq(6, max_tokens=2) for _ in range(4)]
    for seq in seqs:
        sched.add(seq)
    assert plan(run_step(sched)) == [(s.seq_id, 0, 6, True) for s in seqs]


def test_decodes_beyond_the_token_budget_wait_for_the_next_step():
    sched = make_scheduler(policy="fcfs", max_num_batched_tokens=2, max_num_seqs=4)
    a, b, c = (make_seq(1, max_tokens=3, arrival_time=t) for t in (1.0, 2.0, 3.0))
    for seq in (a, b, c):
        sched.add(seq)
    assert plan(run_step(sched)) == [(a.seq_id, 0, 1, True), (b.seq_id, 0, 1, True)]
    assert plan(run_step(sched)) == [(a.seq_id, 1, 1, True), (b.seq_id, 1, 1, True)]
    assert plan(run_step(sched)) == [(a.seq_id, 2, 1, True), (b.seq_id, 2, 1, True)]
    assert plan(run_step(sched)) == [(c.seq_id, 0, 1, True)]


# ---------------------------------------------------------------- preemption


def three_one_block_sequences(priorities=(0, 0, 0)):
    """4 blocks of 4 tokens; three 4-token prompts that fit in one block each."""
    kv = make_kv(num_blocks=4, block_size=4)
    sched = make_scheduler(kv, policy="fcfs", max_num_seqs=4)
    seqs = [
        make_seq(4, max_tokens=8, tenant=name, priority=p, arrival_time=t)
        for name, p, t in zip("abc", priorities, (1.0, 2.0, 3.0), strict=True)
    ]
    for seq in seqs:
        assert sched.add(seq).accepted
    first = run_step(sched)
    assert plan(first) == [(s.seq_id, 0, 4, True) for s in seqs]
    assert kv.num_free_blocks == 1
    return kv, sched, seqs


def test_preemption_takes_the_latest_arrival_and_it_later_completes():
    kv, sched, (a, b, c) = three_one_block_sequences()
    # Each decode now needs a second block; only one is free. a gets it, b cannot:
    # the least urgent running sequence not yet scheduled is c (latest arrival).
    out = run_step(sched)
    assert plan(out) == [(a.seq_id, 4, 1, True), (b.seq_id, 4, 1, True)]
    assert out.preempted == [c.seq_id]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and c.num_output_tokens == 1  # output kept for recompute
    assert sched.waiting == [c] and sched.num_preemptions == 1

    for _ in range(3):  # positions 5..7 stay in the second block: no admission (no free block)
        assert [i.seq.seq_id for i in run_step(sched).scheduled] == [a.seq_id, b.seq_id]
    # Position 8 needs a third block for both: b (later arrival) is preempted for a, and
    # goes to the front of the queue, ahead of c.
    out = run_step(sched)
    assert plan(out) == [(a.seq_id, 8, 1, True)] and out.preempted == [b.seq_id]
    assert sched.waiting == [b, c] and b.num_preemptions == 1

    run_until_idle(sched)
    for seq in (a, b, c):
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.output_token_ids == [7] * 8
    assert kv.num_free_blocks == kv.max_blocks_per_sequence
    # Recomputation is not charged: each tenant paid 4 prompt tokens + 8 outputs * 2.
    stats = sched.stats()
    assert {name: t.service for name, t in stats.tenants.items()} == {"a": 20, "b": 20, "c": 20}
    assert stats.num_preemptions == 2
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 1, 1)
    assert stats.num_finished == 3


def test_preemption_takes_the_least_urgent_priority_before_arrival_order():
    _, sched, (a, b, c) = three_one_block_sequences(priorities=(1, 0, 0))
    # Visited most urgent first: b, c, then a. c cannot grow; a (priority 1) is the
    # victim although it arrived first.
    out = run_step(sched)
    assert plan(out) == [(b.seq_id, 4, 1, True), (c.seq_id, 4, 1, True)]
    assert out.preempted == [a.seq_id]
    run_until_idle(sched)
    assert all(s.num_output_tokens == 8 for s in (a, b, c))


def test_a_recomputed_sequence_prefills_prompt_and_output_then_samples_a_new_token():
    _, sched, (a, _, c) = three_one_block_sequences()
    run_step(sched)  # c preempted with 1 output token
    while not a.is_finished:
        run_step(sched)
    resumed = None
    while resumed is None:
        out = run_step(sched)
        resumed = next((i for i in out.scheduled if i.seq is c), None)
    assert (resumed.start, resumed.num_new_tokens, resumed.samples) == (0, 5, True)


def test_a_prefill_chunk_shrinks_to_the_free_blocks_before_anyone_is_preempted():
    kv = make_kv(num_blocks=6, block_size=4)
    sched = make_scheduler(kv, policy="fcfs", max_num_batched_tokens=16)
    a = make_seq(8, max_tokens=8, arrival_time=1.0)
    b = make_seq(16, max_tokens=2, arrival_time=2.0)
    sched.add(a)
    sched.add(b)
    assert plan(run_step(sched)) == [(a.seq_id, 0, 8, True), (b.seq_id, 0, 8, False)]
    assert kv.num_free_blocks == 2
    # a's decode takes a block; b wanted 8 more tokens (2 blocks) but gets the 4 that fit.
    out = run_step(sched)
    assert plan(out) == [(a.seq_id, 8, 1, True), (b.seq_id, 8, 4, False)]
    assert out.preempted == [] and kv.num_free_blocks == 0
    # Now not one token of b fits: b is the least urgent and is preempted.
    out = run_step(sched)
    assert plan(out) == [(a.seq_id, 9, 1, True)] and out.preempted == [b.seq_id]
    run_until_idle(sched)
    assert (a.num_output_tokens, b.num_output_tokens) == (8, 2)
    assert kv.num_free_blocks == 6


# ---------------------------------------------------------------- abort


def test_abort_waiting_and_running_frees_at_once():
    kv = make_kv(num_blocks=8)
    sched = make_scheduler(kv, policy="fcfs", max_num_seqs=1)
    a, b = make_seq(8, max_tokens=4), make_seq(4, max_tokens=4)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert kv.num_free_blocks == 6  # a's 8 prompt tokens in 2 blocks; b waits (max_num_seqs=1)
    assert sched.abort(b.seq_id)  # waiting
    assert b.status is SequenceStatus.FINISHED and b.finish_reason is FinishReason.ABORT
    assert sched.abort(a.seq_id)  # running
    assert kv.num_free_blocks == 8
    assert not sched.abort(a.seq_id) and not sched.abort(12345)
    out = sched.schedule()
    assert out.is_empty and out.finished == [b.seq_id, a.seq_id]
    assert sched.stats().num_aborted == 2


def test_abort_between_schedule_and_update_is_skipped_by_update():
    kv = make_kv(num_blocks=8)
    sched = make_scheduler(kv, policy="fcfs")
    a, b = make_seq(4, max_tokens=4), make_seq(4, max_tokens=4)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort(b.seq_id)
    sched.update(out, StepResult(sampled={a.seq_id: 7, b.seq_id: 8}))
    assert a.num_computed_tokens == 4 and b.num_computed_tokens == 0
    assert a.output_token_ids == [7] and b.output_token_ids == []
    assert kv.tables.num_held(b, "full") == 0 and kv.tables.num_held(a, "full") == 1


# ---------------------------------------------------------------- admission and backpressure


def test_queue_full_answers_overloaded_with_a_retry_after_from_throughput():
    clock = FakeClock()
    sched = make_scheduler(policy="fcfs", max_queue_len=2, clock=clock)
    assert sched.add(make_seq(2)).accepted
    assert sched.add(make_seq(2)).accepted
    refused = sched.add(make_seq(2))
    assert refused.status is AdmissionStatus.OVERLOADED and not refused.accepted
    assert refused.retry_after_s == 1  # nothing completed yet: the default
    assert "overloaded" in refused.message

    run_until_idle(sched)  # 2 completions at t=1000
    sched.add(make_seq(2))
    sched.add(make_seq(2))
    refused = sched.add(make_seq(2))
    # 2 completions in the 30 s window: one slot frees every 15 s.
    assert refused.status is AdmissionStatus.OVERLOADED and refused.retry_after_s == 15
    assert sched.stats().rejected == {"overloaded": 2}


def test_completion_rate_retry_hint():
    rate = CompletionRate(window_s=30.0)
    assert rate.retry_after_s(now=0.0) == 1
    for t in range(6):
        rate.record(1000.0 + t)
    assert rate.per_second(1010.0) == pytest.approx(0.2)
    assert rate.retry_after_s(1010.0) == 5
    assert rate.retry_after_s(1031.0) == 8  # 1000 and 1001 left the window: 4 / 30 s
    assert rate.retry_after_s(2000.0) == 1  # all expired: the default again
    slow = CompletionRate(window_s=120.0)
    slow.record(0.0)
    assert slow.retry_after_s(1.0) == 60  # clamped


def test_per_tenant_limit():
    sched = make_scheduler(policy="vtc", max_inflight_per_tenant=2)
    a, b = make_seq(2, tenant="t1"), make_seq(2, tenant="t1")
    assert sched.add(a).accepted and sched.add(b).accepted
    refused = sched.add(make_seq(2, tenant="t1"))
    assert refused.status is AdmissionStatus.LIMITED and refused.retry_after_s == 1
    assert "'t1'" in refused.message
    assert sched.add(make_seq(2, tenant="t2")).accepted
    sched.abort(a.seq_id)
    assert sched.add(make_seq(2, tenant="t1")).accepted


def test_per_session_limit():
    sched = make_scheduler(policy="fcfs", max_inflight_per_session=1, max_num_seqs=4)
    a = make_seq(2, max_tokens=1, session_id="s1")
    assert sched.add(a).accepted
    refused = sched.add(make_seq(2, session_id="s1"))
    assert refused.status is AdmissionStatus.LIMITED and "'s1'" in refused.message
    assert sched.add(make_seq(2, session_id="s2")).accepted
    assert sched.add(make_seq(2)).accepted  # no session: not limited
    assert sched.add(make_seq(2)).accepted
    run_step(sched)  # a finishes (max_tokens=1)
    assert a.is_finished
    assert sched.add(make_seq(2, session_id="s1")).accepted


def test_a_request_that_can_never_fit_the_kv_cache_is_refused():
    kv = make_kv(num_blocks=8, block_size=4)
    sched = make_scheduler(kv, policy="fcfs", max_num_batched_tokens=16)
    refused = sched.add(make_seq(30, max_tokens=4))  # needs 30 + 4 - 1 = 33 > 32 tokens
    assert refused.status is AdmissionStatus.TOO_LARGE and refused.retry_after_s is None
    assert "33" in refused.message and "32" in refused.message
    assert sched.add(make_seq(29, max_tokens=4)).accepted  # exactly 32
    # Under an eviction budget it holds at most max_kv_tokens + one step's chunk.
    evicting = make_seq(20, max_tokens=100, eviction_policy="sink", max_kv_tokens=8)
    assert kv_tokens_needed(evicting, sched.config) == 24
    assert sched.add(evicting).accepted
    assert sched.stats().rejected == {"too_large": 1}


def test_adding_the_same_sequence_twice_is_a_bug():
    sched = make_scheduler()
    seq = make_seq(2)
    sched.add(seq)
    with pytest.raises(ValueError):
        sched.add(seq)


def test_stats_snapshot():
    sched = make_scheduler(policy="vtc", max_num_seqs=1)
    a, b = make_seq(3, max_tokens=2, tenant="x"), make_seq(5, max_tokens=2, tenant="y")
    sched.add(a)
    sched.add(b)
    run_step(sched)
    stats = sched.stats()
    assert (stats.policy, stats.num_running, stats.num_waiting) == ("vtc", 1, 1)
    assert stats.tenants["x"].running == 1 and stats.tenants["y"].waiting == 1
    assert (stats.tenants["x"].prompt_tokens, stats.tenants["x"].output_tokens) == (3, 1)
    assert stats.tenants["x"].service == 5.0 and stats.tenants["x"].counter == 5.0
    assert stats.tenants["y"].counter == 0.0 and stats.tenants["y"].service == 0.0
    assert stats.to_dict()["tenants"]["x"]["service"] == 5.0


def test_config_validation():
    with pytest.raises(ValueError):
        make_scheduler(max_num_seqs=0)
    with pytest.raises(ValueError):
        make_scheduler(max_inflight_per_tenant=0)
    with pytest.raises(ValueError):
        make_scheduler(prefill_group_tokens=0)
    with pytest.raises(ValueError):
        make_scheduler(policy="lottery")
