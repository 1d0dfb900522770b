"""Fairness simulation: two always-backlogged tenants, one submitting four times as many
requests, driven step by step through the real scheduler and KV manager with a stand-in
"model" that just emits tokens.

The bound (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024, §4): for
two tenants backlogged over [t1, t2), VTC keeps the difference of the service they received
within 2U, U = max(w_p * L_input, w_q * M), where L_input is the longest prompt and M the
most tokens a running batch can hold (here the whole KV cache). Service is the weighted
token count w_p * prompt + w_q * output; both tenants are backlogged from the first step,
so their service since then is exactly what the test compares.
"""

from __future__ import annotations

import itertools
from functools import cache

from engine.request import FinishReason
from engine.sched.stats import ServiceGapTracker, TenantStats
from tests.sched_driver import make_kv, make_scheduler, make_seq, run_step

PROMPT_LENS = (5, 12, 8, 3)
OUTPUT_LENS = (6, 10, 4, 8)
NUM_BLOCKS, BLOCK_SIZE = 14, 4  # 56 tokens: 4 running sequences do not always fit -> preemptions
W_P, W_Q = 1.0, 2.0
STEPS = 300
CHECKPOINTS = (50, 100, 200, 300)

L_INPUT = max(PROMPT_LENS)
M = NUM_BLOCKS * BLOCK_SIZE
PAPER_BOUND = 2 * max(W_P * L_INPUT, W_Q * M)  # 2U = 224
LARGEST_REQUEST = max(W_P * p + W_Q * q for p in PROMPT_LENS for q in OUTPUT_LENS)  # 32


def build(policy: str):
    sched = make_scheduler(
        make_kv(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE),
        policy=policy,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_queue_len=1000,
    )
    counter = itertools.count()
    seqs = []
    for _ in range(100):  # arrival order A A A A B, repeated: A sends four times as many
        for tenant in "AAAAB":
            j = next(counter)
            seq = make_seq(PROMPT_LENS[j % 4], max_tokens=OUTPUT_LENS[(j // 4) % 4], tenant=tenant)
            assert sched.add(seq).accepted
            seqs.append(seq)
    return sched, seqs


@cache
def service_gaps(policy: str) -> tuple[float, ...]:
    """service(A) - service(B) after each of STEPS steps, both tenants backlogged throughout."""
    sched, _ = build(policy)
    gaps = []
    for _ in range(STEPS):
        run_step(sched)
        backlogged = {seq.tenant for seq in sched.waiting}
        assert backlogged == {"A", "B"}, "both tenants must stay backlogged"
        gaps.append(sched.ledger.service("A") - sched.ledger.service("B"))
    return tuple(gaps)


def test_the_bound():
    assert (L_INPUT, M, PAPER_BOUND, LARGEST_REQUEST) == (12, 56, 224.0, 32.0)


def test_vtc_keeps_the_service_gap_within_the_paper_bound():
    gaps = service_gaps("vtc")
    worst = max(abs(gap) for gap in gaps)
    assert worst <= PAPER_BOUND
    # In this workload it even stays within two of the largest single requests.
    assert worst <= 2 * LARGEST_REQUEST


def test_fcfs_service_gap_exceeds_the_bound_by_a_growing_margin():
    gaps = service_gaps("fcfs")
    margins = [gaps[step - 1] - PAPER_BOUND for step in CHECKPOINTS]
    assert margins[0] > 0
    assert all(later > earlier for earlier, later in itertools.pairwise(margins))
    # Roughly the 4:1 split of arrivals: A gets about four times B's service.
    assert gaps[-1] > 1500


def test_vtc_serves_both_tenants_equally_while_fcfs_follows_the_arrival_mix():
    sched_vtc, _ = build("vtc")
    sched_fcfs, _ = build("fcfs")
    for _ in range(STEPS):
        run_step(sched_vtc)
        run_step(sched_fcfs)
    share_vtc = sched_vtc.ledger.service("B") / sched_vtc.ledger.service("A")
    share_fcfs = sched_fcfs.ledger.service("B") / sched_fcfs.ledger.service("A")
    assert 0.95 < share_vtc < 1.05
    assert 0.2 < share_fcfs < 0.3


def test_every_accepted_request_completes_despite_preemptions():
    sched, seqs = build("vtc")
    steps = 0
    while sched.has_work:
        run_step(sched)
        steps += 1
        assert steps < 5000
    assert sched.num_preemptions > 0
    for seq in seqs:
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.num_output_tokens == seq.sampling.max_tokens
    assert sched.kv.num_free_blocks == NUM_BLOCKS
    stats = sched.stats()
    assert stats.num_finished == 500 and stats.num_running == stats.num_waiting == 0
    # Everything was charged exactly once, preemptions notwithstanding.
    for tenant in "AB":
        mine = [s for s in seqs if s.tenant == tenant]
        expected = sum(W_P * s.num_prompt_tokens + W_Q * s.num_output_tokens for s in mine)
        assert stats.tenants[tenant].service == expected


def test_the_live_gap_tracker_counts_prefilling_tenants_as_backlogged():
    tracker = ServiceGapTracker()
    queued = {"a": TenantStats(waiting=1, service=10.0), "b": TenantStats(prefilling=1)}
    tracker.observe(queued)
    tracker.observe({"a": TenantStats(waiting=1, service=40.0), "b": TenantStats(prefilling=1)})
    assert tracker.current() == (30.0, ("a", "b"))
    # b only decodes now: no longer backlogged, the stretch ends; the largest gap is kept.
    tracker.observe({"a": TenantStats(waiting=1, service=90.0), "b": TenantStats(running=1)})
    assert tracker.current() == (0.0, None) and tracker.max_seen == 30.0
