"""Policies: fcfs and priority ordering, VTC counter arithmetic, selection and the lift rule."""

from __future__ import annotations

import pytest

from engine.sched.policy import FcfsPolicy, PriorityPolicy, TokenCost, VtcPolicy, make_policy
from tests.sched_driver import make_kv, make_scheduler, make_seq, plan, run_step


def admission_order(policy: str, seqs) -> list[int]:
    """Run one sequence at a time; return seq ids in the order they were admitted."""
    sched = make_scheduler(policy=policy, max_num_seqs=1)
    for seq in seqs:
        assert sched.add(seq).accepted
    order = []
    while sched.has_work:
        for item in run_step(sched).scheduled:
            if item.start == 0:
                order.append(item.seq.seq_id)
    return order


def mixed_priorities():
    # arrival order a, b, c, d; priorities 5, 0, 2, 0 (lower = more urgent)
    return [make_seq(2, max_tokens=1, priority=p) for p in (5, 0, 2, 0)]


def test_fcfs_admits_in_arrival_order_ignoring_priority():
    a, b, c, d = mixed_priorities()
    assert admission_order("fcfs", [a, b, c, d]) == [a.seq_id, b.seq_id, c.seq_id, d.seq_id]


def test_priority_policy_admits_most_urgent_first_then_in_arrival_order():
    a, b, c, d = mixed_priorities()
    assert admission_order("priority", [a, b, c, d]) == [b.seq_id, d.seq_id, c.seq_id, a.seq_id]


def test_policy_objects_select_directly():
    a, b, c, d = mixed_priorities()
    assert FcfsPolicy().select([a, b, c, d]) is a
    assert PriorityPolicy().select([a, c, d, b]) is d  # equal priorities keep queue order
    assert make_policy("priority").name == "priority"
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_policy("round-robin")


# ---------------------------------------------------------------- VTC arithmetic


def test_vtc_counter_arithmetic():
    vtc = VtcPolicy(TokenCost(prompt_weight=1.0, output_weight=2.0))
    vtc.charge("a", 10, 0)
    assert vtc.counter("a") == 10.0
    vtc.charge("a", 0, 3)
    assert vtc.counter("a") == 16.0
    vtc.charge("b", 4, 1)
    assert vtc.counters() == {"a": 16.0, "b": 6.0}
    heavy_output = VtcPolicy(TokenCost(prompt_weight=0.5, output_weight=4.0))
    heavy_output.charge("a", 10, 2)
    assert heavy_output.counter("a") == 13.0


def test_vtc_charges_prompt_chunks_and_each_sampled_token_as_scheduled():
    sched = make_scheduler(policy="vtc", max_num_batched_tokens=4)
    seq = make_seq(10, max_tokens=3, tenant="x")
    sched.add(seq)
    counters = []
    while sched.has_work:
        run_step(sched)
        counters.append(sched.policy.counter("x"))
    # chunks of 4, 4, then 2 + the first token (2), then two decodes of 2 each.
    assert counters == [4.0, 8.0, 12.0, 14.0, 16.0]
    usage = sched.ledger.tenants["x"]
    assert (usage.prompt_tokens, usage.output_tokens, usage.service) == (10, 3, 16.0)


def test_vtc_does_not_charge_prefix_cache_hits():
    kv = make_kv(num_blocks=16, block_size=4, prefix_caching=True)
    sched = make_scheduler(kv, policy="vtc")
    first = make_seq(8, max_tokens=1, tenant="x")
    sched.add(first)
    run_step(sched)
    assert sched.policy.counter("x") == 8.0 + 2.0
    again = make_seq(0, max_tokens=1, tenant="y")
    again.prompt_token_ids = list(first.prompt_token_ids)
    sched.add(again)
    out = run_step(sched)
    # The exact-match index serves 7 of the 8 prompt tokens; one is recomputed for logits.
    assert [(i.start, i.num_new_tokens) for i in out.scheduled] == [(7, 1)]
    assert again.num_cached_prompt_tokens == 7
    assert sched.ledger.service("y") == 1.0 + 2.0
    # y's counter was first lifted to x's (x left the empty queue last), then charged 3.
    assert sched.policy.counter("y") == 10.0 + 3.0


# ---------------------------------------------------------------- VTC selection


def test_vtc_selects_the_backlogged_tenant_with_the_smallest_counter():
    vtc = VtcPolicy()
    a1, b1, a2 = make_seq(2, tenant="A"), make_seq(2, tenant="B"), make_seq(2, tenant="A")
    vtc.charge("A", 10, 0)
    vtc.charge("B", 5, 0)
    assert vtc.select([a1, b1, a2]) is b1
    vtc.charge("B", 5, 0)  # tie at 10: the tenant nearest the head of the queue
    assert vtc.select([a1, b1, a2]) is a1
    assert vtc.select([b1, a1, a2]) is b1
    # Unknown tenants count as 0.
    c1 = make_seq(2, tenant="C")
    assert vtc.select([a1, b1, c1]) is c1


def test_vtc_uses_priority_within_a_tenant():
    vtc = VtcPolicy()
    a1, a2, a3 = (make_seq(2, tenant="A", priority=p) for p in (3, 1, 1))
    b1 = make_seq(2, tenant="B", priority=0)
    vtc.charge("B", 1, 0)  # B is behind A=0 in the counters: A is served first anyway
    assert vtc.select([a1, b1, a2, a3]) is a2


# ---------------------------------------------------------------- VTC lift (Algorithm 2)


def test_vtc_lift_to_the_smallest_counter_in_the_queue():
    vtc = VtcPolicy()
    x, y = make_seq(2, tenant="x"), make_seq(2, tenant="y")
    vtc.charge("x", 10, 0)
    vtc.charge("y", 30, 0)
    newcomer = make_seq(2, tenant="z")
    vtc.on_arrival(newcomer, [x, y])
    assert vtc.counter("z") == 10.0  # max(0, min(10, 30))
    # A tenant already above the floor keeps its counter.
    vtc.charge("w", 50, 0)
    vtc.on_arrival(make_seq(2, tenant="w"), [x, y])
    assert vtc.counter("w") == 50.0


def test_vtc_no_lift_while_the_tenant_has_a_request_in_the_queue():
    vtc = VtcPolicy()
    x, z = make_seq(2, tenant="x"), make_seq(2, tenant="z")
    vtc.charge("x", 10, 0)
    vtc.on_arrival(make_seq(2, tenant="z"), [x, z])
    assert vtc.counter("z") == 0.0


def test_vtc_lift_on_an_empty_queue_uses_the_tenant_that_last_left_it():
    vtc = VtcPolicy()
    nobody_left = make_seq(2, tenant="z")
    vtc.on_arrival(nobody_left, [])
    assert vtc.counter("z") == 0.0  # nothing ever left the queue: no lift
    x, y = make_seq(2, tenant="x"), make_seq(2, tenant="y")
    vtc.charge("x", 40, 0)
    vtc.charge("y", 25, 0)
    vtc.on_prefilled(x)
    vtc.on_prefilled(y)  # y left last
    vtc.on_arrival(make_seq(2, tenant="z"), [])
    assert vtc.counter("z") == 25.0  # c_l of y, not the larger counter of x


def test_vtc_lift_through_the_scheduler():
    sched = make_scheduler(policy="vtc", max_num_seqs=4)
    a = make_seq(4, max_tokens=10, tenant="A")
    sched.add(a)
    for _ in range(3):
        run_step(sched)
    assert sched.policy.counter("A") == 4 + 3 * 2.0
    # Q is empty (A's request is running); A left Q last, so B starts at A's counter:
    # B's idle time earned no credit.
    b = make_seq(4, max_tokens=2, tenant="B")
    sched.add(b)
    assert sched.policy.counter("B") == 10.0
    stats = sched.stats()
    assert stats.tenants["B"].counter == 10.0 and stats.tenants["B"].service == 0.0


def prefill_trace(policy: str) -> tuple[list, int, int]:
    """A heavy tenant's 40-token prompt is being prefilled 8 tokens a step when a light
    tenant's 6-token prompt arrives; returns (the steps' plans, H's and L's seq ids)."""
    sched = make_scheduler(policy=policy, max_num_batched_tokens=8, max_num_seqs=4)
    heavy = make_seq(40, max_tokens=2, tenant="H")
    sched.add(heavy)
    plans = [plan(run_step(sched))]
    light = make_seq(6, max_tokens=1, tenant="L")
    sched.add(light)
    while sched.has_work:
        plans.append(plan(run_step(sched)))
    return plans, heavy.seq_id, light.seq_id


def test_vtc_gives_the_step_budget_to_the_least_served_tenant_before_running_prefills():
    plans, h, light = prefill_trace("vtc")
    # L arrives while H's prompt queues for prefill: lifted to H's counter (8), a tie, which
    # goes to the shorter rest of a prompt (L's 6 tokens against H's 32); H takes what is left.
    assert plans == [
        [(h, 0, 8, False)],
        [(light, 0, 6, True), (h, 8, 2, False)],
        [(h, 10, 8, False)],
        [(h, 18, 8, False)],
        [(h, 26, 8, False)],
        [(h, 34, 6, True)],
        [(h, 40, 1, True)],
    ]


def test_vtc_prefills_a_tenants_two_short_prompts_before_anothers_long_one():
    # H's 40-token prompt is prefilled 8 tokens a step; L then sends two 3-token prompts at
    # once, lifted to H's counter (8). Finish tags: L's first 8 + 3, H's 8 + 32. Once L's
    # first is charged (L at 11) its second's tag is 14, still below H's 40: both go in this
    # step. (Ranked by counter alone, H at 8 would take the rest and L's second would wait.)
    sched = make_scheduler(policy="vtc", max_num_batched_tokens=8, max_num_seqs=4)
    heavy = make_seq(40, max_tokens=2, tenant="H")
    sched.add(heavy)
    run_step(sched)
    first, second = make_seq(3, max_tokens=1, tenant="L"), make_seq(3, max_tokens=1, tenant="L")
    sched.add(first)
    sched.add(second)
    assert plan(run_step(sched)) == [
        (first.seq_id, 0, 3, True),
        (second.seq_id, 0, 3, True),
        (heavy.seq_id, 8, 2, False),
    ]
    # L: lifted to 8, then 2 x (3 prompt tokens + one sampled token at w_q = 2).
    assert sched.policy.counters() == {"H": 10.0, "L": 18.0}


def test_vtc_finish_tag_and_selection_by_it():
    vtc = VtcPolicy(TokenCost(prompt_weight=2.0, output_weight=1.0))
    long_a, short_b = make_seq(30, tenant="A"), make_seq(4, tenant="B")
    vtc.charge("B", 40, 0)  # B is ahead on the counter (80 against 0) ...
    assert vtc.finish_tag(long_a) == 60.0 and vtc.finish_tag(short_b) == 88.0
    assert vtc.select([short_b, long_a]) is long_a
    vtc.charge("A", 15, 0)  # ... until A's long prompt would finish past B's short one
    assert vtc.finish_tag(long_a) == 90.0
    assert vtc.select([long_a, short_b]) is short_b
    long_a.num_computed_tokens = 20  # the computed part of a prompt no longer counts
    assert vtc.finish_tag(long_a) == 50.0
    assert vtc.prefill_rank(long_a) == (50.0, 10)


def test_fcfs_prefills_running_prompts_before_admitting_anyone():
    plans, h, light = prefill_trace("fcfs")
    assert plans == [
        [(h, 0, 8, False)],
        [(h, 8, 8, False)],
        [(h, 16, 8, False)],
        [(h, 24, 8, False)],
        [(h, 32, 8, True)],
        [(h, 40, 1, True), (light, 0, 6, True)],
    ]


def test_vtc_lift_counts_running_prompts_still_prefilling_as_queued():
    sched = make_scheduler(policy="vtc", max_num_batched_tokens=8, max_num_seqs=4)
    sched.add(make_seq(40, max_tokens=2, tenant="H"))
    run_step(sched)
    run_step(sched)  # H: 16 prompt tokens charged, its request still prefilling
    sched.add(make_seq(4, tenant="L"))
    assert not sched.waiting[1:] and sched.policy.counter("L") == 16.0
