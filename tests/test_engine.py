"""The engine step loop on the real embedded Gemma 3 270M: batching, chunked prefill, prefix
reuse, preemption, aborts, and the asyncio AsyncEngine. Greedy outputs are compared exactly
with each prompt generated alone (tests/engine_harness.greedy_alone)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from engine import async_engine
from engine.async_engine import AsyncEngine, EngineOverloaded, RequestTooLarge
from engine.request import FinishReason, Sequence
from engine.sched.config import SchedulerConfig
from tests.engine_harness import (
    PROMPTS,
    encode,
    greedy,
    greedy_alone,
    long_prompt,
    new_engine,
    one_torch_thread,  # noqa: F401 (a fixture)
    recorded_forwards,
    run,
)
from tests.kv_invariants import assert_all_released, check_manager

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def loaded(embedded_model):
    return embedded_model


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    ids = [encode(loaded, text) for text in PROMPTS]
    assert len({len(p) for p in ids}) == len(ids)  # all lengths differ
    return ids


def test_batched_sequences_match_each_alone(loaded, prompts):
    alone = [greedy_alone(loaded, p, 32) for p in prompts]
    engine = new_engine(loaded, max_active_tokens=1024)
    seqs = [Sequence(p, greedy(32)) for p in prompts]
    steps = run(engine, seqs)
    # One step prefills all six and samples their first token, then 31 decode steps of six.
    assert [len(outputs) for outputs in steps] == [6] * 32
    assert [seq.output_token_ids for seq in seqs] == alone
    assert all(seq.finish_reason is FinishReason.LENGTH for seq in seqs)
    assert_all_released(engine.kv)


def test_chunked_prefill_matches_one_chunk_and_never_stalls_decodes(loaded, prompts):
    long = long_prompt(loaded, 600)
    long_alone = greedy_alone(loaded, long, 6)  # prefilled in one 600-token step
    short_alone = greedy_alone(loaded, prompts[0], 16)
    budget = 128
    engine = new_engine(
        loaded,
        max_active_tokens=2048,
        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
    )
    short = Sequence(prompts[0], greedy(16))
    long_seq = Sequence(long, greedy(6))
    assert engine.add(short).accepted
    engine.step()  # short is decoding from now on
    assert engine.add(long_seq).accepted

    prefill_steps = 0
    while not long_seq.output_token_ids:
        before = long_seq.num_computed_tokens
        outputs = engine.step()
        prefill_steps += 1
        # Every step of the long prefill also gave the short sequence its next token.
        assert [(seq, len(out.new_token_ids)) for seq, out in outputs if seq is short] == [
            (short, 1)
        ]
        assert long_seq.num_computed_tokens - before <= budget - 1
    assert prefill_steps == math.ceil(len(long) / (budget - 1))
    run(engine)
    assert long_seq.output_token_ids == long_alone
    assert short.output_token_ids == short_alone
    assert_all_released(engine.kv)


def test_contexts_past_the_window_in_shared_pages(loaded):
    """The embedded model's cache groups share one page pool (3 layers a page: a full-attention
    block is 1 page, a sliding one 5). Two 700-token sequences, past the 512-token window,
    would hold 2 x (44 + 44 x 5) = 528 pages at their peaks without the window; in 450 they
    decode exactly as each alone, the pages the window frees are reused, and every page
    comes back."""
    prompts = [long_prompt(loaded, 700, topic=topic) for topic in ("square", "cube")]
    alone = [greedy_alone(loaded, prompt, 8) for prompt in prompts]
    engine = new_engine(
        loaded,
        max_active_tokens=1200,  # 1,200 * 18 layers / (16 tokens * 3 layers) = 450 pages
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256),
    )
    pools = engine.kv.pools
    assert (pools["full"].pages_per_block, pools["sliding"].pages_per_block) == (1, 5)
    assert engine.kv.stats()["shared_pages"]["total"] == 450
    seqs = [Sequence(prompt, greedy(8)) for prompt in prompts]
    run(engine, seqs)
    assert [seq.output_token_ids for seq in seqs] == alone
    stats = engine.kv.stats()
    assert stats["window_freed_blocks"] > 0
    assert stats["groups"]["sliding"]["reclaimed"] + stats["groups"]["full"]["reclaimed"] > 0
    assert_all_released(engine.kv)


def test_repeated_long_prompt_reuses_the_cached_prefix(loaded):
    prompt = long_prompt(loaded, 1000, topic="double")
    engine = new_engine(
        loaded,
        max_active_tokens=4096,
        scheduler=SchedulerConfig(max_num_batched_tokens=2048),
    )
    first, second = Sequence(prompt, greedy(4)), Sequence(prompt, greedy(4))
    with recorded_forwards(engine.runner) as batches:
        run(engine, [first])
    assert first.num_cached_prompt_tokens == 0
    assert [b.input_ids.numel() for b in batches] == [1000, 1, 1, 1]

    hits_before = engine.kv.stats()["prefix_cache"]["hit_tokens"]
    with recorded_forwards(engine.runner) as batches:
        steps = run(engine, [second])
    cached = second.num_cached_prompt_tokens
    assert cached >= 992
    assert steps[0][0][1].num_cached_tokens == cached
    assert engine.kv.stats()["prefix_cache"]["hit_tokens"] - hits_before == cached
    # Only the uncached rest of the prompt went through the model.
    assert [b.input_ids.numel() for b in batches] == [1000 - cached, 1, 1, 1]
    assert second.output_token_ids == first.output_token_ids
    assert_all_released(engine.kv)


def test_preemption_under_a_tiny_kv_budget_keeps_outputs_and_frees_everything(loaded, prompts):
    alone = [greedy_alone(loaded, p, 32)[:16] for p in prompts]
    # 8 blocks of 16 tokens: each sequence fits alone (at most 28 + 15 tokens), all six do not.
    engine = new_engine(loaded, max_active_tokens=128)
    seqs = [Sequence(p, greedy(16)) for p in prompts]
    for seq in seqs:
        assert engine.add(seq).accepted
    while engine.has_work:
        engine.step()
        check_manager(engine.kv)
    assert engine.scheduler.stats().num_preemptions > 0
    assert any(seq.num_preemptions for seq in seqs)
    assert [seq.output_token_ids for seq in seqs] == alone
    assert engine.scheduler.stats().num_finished == len(seqs)
    assert_all_released(engine.kv)  # every group: cached blocks count as free
    for pool in engine.kv.pools.values():
        assert all(block.ref_count == 0 for block in pool.live.values())
        assert pool.num_in_use == 0 and pool.num_available == pool.num_total


def test_abort_mid_prefill_mid_decode_and_waiting_frees_every_block(loaded, prompts):
    short_alone = greedy_alone(loaded, prompts[0], 4)
    engine = new_engine(
        loaded,
        max_active_tokens=1024,
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2),
    )
    decoding = Sequence(prompts[0], greedy(32))
    prefilling = Sequence(long_prompt(loaded, 300), greedy(4))
    waiting = Sequence(prompts[1], greedy(4))  # max_num_seqs=2 keeps it queued
    assert engine.add(decoding).accepted
    engine.step()
    assert engine.add(prefilling).accepted
    assert engine.add(waiting).accepted
    engine.step()
    engine.step()
    assert decoding.num_output_tokens == 3
    assert 0 < prefilling.num_computed_tokens < prefilling.num_prompt_tokens
    assert not prefilling.output_token_ids and waiting.num_computed_tokens == 0
    assert (
        engine.kv.tables.num_held(decoding, "full") > 0
        and engine.kv.tables.num_held(prefilling, "full") > 0
    )

    for seq in (prefilling, decoding, waiting):
        assert engine.abort(seq.seq_id)
        assert engine.kv.tables.num_held(seq, "full") == 0
        assert seq.finish_reason is FinishReason.ABORT
    assert not engine.abort(decoding.seq_id)  # already gone
    assert not engine.has_work
    assert engine.scheduler.stats().num_aborted == 3
    assert_all_released(engine.kv)

    # The blocks the aborted sequences left in the prefix cache are sound to reuse.
    again = Sequence(prompts[0], greedy(4))
    run(engine, [again])
    assert again.num_cached_prompt_tokens == len(prompts[0]) - 1
    assert again.output_token_ids == short_alone
    assert_all_released(engine.kv)


async def _wait_until(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_async_engine_streams_concurrent_requests_and_frees_an_abandoned_one(loaded, prompts):
    alone = [greedy_alone(loaded, p, 6) for p in prompts[:4]]
    engine = new_engine(loaded, max_active_tokens=1024)
    server = AsyncEngine(lambda: engine)
    server.start()
    try:

        async def consume(i: int) -> tuple[list[int], str, list]:
            stream = server.submit(Sequence(prompts[i], greedy(6), request_id=f"r{i}"))
            outputs = [out async for out in stream]
            return [t for out in outputs for t in out.new_token_ids], stream.seq, outputs

        results = await asyncio.gather(*(consume(i) for i in range(4)))
        for (tokens, seq, outputs), expected in zip(results, alone, strict=True):
            assert tokens == expected
            assert [out.finished for out in outputs] == [False] * 5 + [True]
            assert outputs[-1].finish_reason is FinishReason.LENGTH
            assert seq.finish_reason is FinishReason.LENGTH

        # A consumer that stops iterating aborts its request.
        leaver = Sequence(prompts[4], greedy(200), request_id="leaver")
        received = 0
        async for _ in server.submit(leaver):
            received += 1
            if received == 2:
                break
        await _wait_until(lambda: leaver.is_finished)
        assert leaver.finish_reason is FinishReason.ABORT
        assert leaver.num_output_tokens < 200
        await _wait_until(lambda: not engine.has_work)
        assert_all_released(engine.kv)
        assert engine.scheduler.stats().num_aborted == 1
    finally:
        await server.shutdown(grace_s=0)


async def test_async_engine_refuses_when_the_queue_is_full(loaded, prompts):
    engine = new_engine(loaded, max_active_tokens=256, scheduler=SchedulerConfig(max_queue_len=1))
    server = AsyncEngine(lambda: engine)
    server.start()
    try:
        # Holding the scheduler's (reentrant) lock stalls the engine thread's next schedule(),
        # so the first request stays in the queue while this thread submits more.
        with engine.scheduler._lock:
            first = server.submit(Sequence(prompts[0], greedy(2), request_id="first"))
            with pytest.raises(EngineOverloaded, match="overloaded") as info:
                server.submit(Sequence(prompts[1], greedy(2), request_id="second"))
            assert isinstance(info.value.retry_after_s, int) and info.value.retry_after_s >= 1
            with pytest.raises(RequestTooLarge):
                server.submit(Sequence(long_prompt(loaded, 300), greedy(2), request_id="huge"))
        outputs = [out async for out in first]
        assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.LENGTH
        # Once the queue drained the same request is accepted.
        second = server.submit(Sequence(prompts[1], greedy(2), request_id="second"))
        assert [out async for out in second][-1].finished
        await _wait_until(lambda: not engine.has_work)
        assert_all_released(engine.kv)
    finally:
        await server.shutdown(grace_s=0)


async def test_submitting_together_starts_a_requests_sequences_in_one_step(loaded, prompts):
    """The gateway submits a request's n choices inside submitting_together(): however long
    the submitting takes, the engine thread schedules none of them before all are in."""
    engine = new_engine(loaded, max_active_tokens=1024)
    server = AsyncEngine(lambda: engine)
    server.start()
    try:
        with recorded_forwards(engine.runner) as batches:
            with server.submitting_together():
                first = server.submit(Sequence(prompts[0], greedy(2), request_id="first"))
                await asyncio.sleep(0.3)  # the engine thread is awake and waits for the lock
                second = server.submit(Sequence(prompts[1], greedy(2), request_id="second"))
            for stream in (first, second):
                assert [out async for out in stream][-1].finished
        assert batches[0].num_seqs == 2  # both prompts in the first step
        await _wait_until(lambda: not engine.has_work)
        assert_all_released(engine.kv)
    finally:
        await server.shutdown(grace_s=0)


async def test_an_idle_engine_gathers_a_burst_of_arrivals_into_one_step(
    loaded, prompts, monkeypatch
):
    """Requests reaching an idle engine each within ARRIVAL_GAP_S of the one before are
    prefilled in one step; one arriving after a longer gap goes into a later step. (The gap is
    widened here so that a loaded test machine's timing cannot split the burst.)"""
    monkeypatch.setattr(async_engine, "ARRIVAL_GAP_S", 0.25)
    monkeypatch.setattr(async_engine, "ARRIVAL_WAIT_MAX_S", 2.0)
    engine = new_engine(loaded, max_active_tokens=1024)
    server = AsyncEngine(lambda: engine)
    server.start()
    try:
        for gap_s, first_step_seqs in [(0.05, 3), (0.6, 1)]:
            await _wait_until(lambda: not engine.has_work)
            with recorded_forwards(engine.runner) as batches:
                streams = []
                for i in range(3):
                    request = Sequence(prompts[i], greedy(2), request_id=f"r{i}-{gap_s}")
                    streams.append(server.submit(request))
                    await asyncio.sleep(gap_s)
                for stream in streams:
                    assert [out async for out in stream][-1].finished
            assert batches[0].num_seqs == first_step_seqs
        await _wait_until(lambda: not engine.has_work)
        assert_all_released(engine.kv)
    finally:
        await server.shutdown(grace_s=0)
