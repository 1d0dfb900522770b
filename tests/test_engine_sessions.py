"""Sessions on the real embedded Gemma 3 270M: a conversation's next turn reuses the previous
turn's KV, and per-session eviction (lru / sink / h2o) keeps a long generation within its
KV budget."""

from __future__ import annotations

import pytest

from engine.request import FinishReason, Sequence
from tests.engine_harness import (
    PROMPTS,
    encode,
    greedy,
    greedy_alone,
    new_engine,
    one_torch_thread,  # noqa: F401 (a fixture)
    recorded_forwards,
    run,
)
from tests.kv_invariants import assert_all_released, check_manager

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

BLOCK = 16


@pytest.fixture(scope="module")
def loaded(embedded_model):
    return embedded_model


def test_next_turn_prefills_only_the_new_text(loaded):
    engine = new_engine(loaded, max_active_tokens=1024, block_size=BLOCK)
    turn1 = Sequence(
        encode(
            loaded,
            "You are a friendly assistant who answers in short lists.\n"
            "User: Name three fruits that are red, please.\nAssistant:",
        ),
        greedy(12),
        session_id="chat",
    )
    run(engine, [turn1])
    history = turn1.prompt_token_ids + turn1.output_token_ids
    new_text = loaded.tokenizer(
        "\nUser: And three green ones?\nAssistant:", add_special_tokens=False
    )
    turn2 = Sequence(history + new_text.input_ids, greedy(8), session_id="chat")

    with recorded_forwards(engine.runner) as batches:
        steps = run(engine, [turn2])
    # Turn 1 computed every token but its last sampled one; its full blocks are reused.
    expected = (len(history) - 1) // BLOCK * BLOCK
    assert expected >= 2 * BLOCK
    assert turn2.num_cached_prompt_tokens == expected
    assert steps[0][0][1].num_cached_tokens == expected
    assert batches[0].input_ids.numel() == turn2.num_prompt_tokens - expected
    assert batches[0].positions[0].item() == expected
    assert turn2.output_token_ids == greedy_alone(loaded, turn2.prompt_token_ids, 8)
    assert_all_released(engine.kv)


def _held_indices(engine, seq, group: str) -> list[int]:
    return [index for _, index in engine.kv.tables.layout(seq)[group]]


def test_eviction_policies_bound_each_sessions_kv(loaded):
    budget_tokens, num_tokens = 64, 200
    budget = budget_tokens // BLOCK
    engine = new_engine(loaded, max_active_tokens=1024, block_size=BLOCK)
    prompt = encode(loaded, PROMPTS[1])
    seqs = {
        policy: Sequence(
            prompt,
            greedy(num_tokens),
            session_id=policy,
            eviction_policy=policy,
            max_kv_tokens=budget_tokens,
        )
        for policy in ("lru", "sink", "h2o")
    }
    for seq in seqs.values():
        assert engine.add(seq).accepted

    h2o_state = None
    while engine.has_work:
        engine.step()
        check_manager(engine.kv)
        for policy, seq in seqs.items():
            if seq.is_finished:
                continue
            assert engine.kv.tables.num_held(seq, "full") <= budget
            full = _held_indices(engine, seq, "full")
            assert len(_held_indices(engine, seq, "sliding")) <= budget
            last = (seq.num_computed_tokens - 1) // BLOCK  # the block of the newest key
            assert full[-1] == last  # is always kept
            if policy == "lru":
                assert full == list(range(last - len(full) + 1, last + 1))
            elif policy == "sink":
                assert full[0] == 0  # the attention sink (first 4 tokens) is never dropped
                assert full[1:] == list(range(last - len(full) + 2, last + 1))
            else:
                # ceil(budget * 0.5) most recent blocks, the rest chosen by attention mass
                assert full[-2:] == [last - 1, last] or len(full) < 2
                h2o_state = engine.kv.tables.seqs[seq.seq_id]
                assert h2o_state.scores, "h2o got no attention mass from the backend"
                assert set(h2o_state.scores) <= set(full)
                assert all(score > 0 for score in h2o_state.scores.values())

    assert h2o_state is not None
    for seq in seqs.values():
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.num_output_tokens == num_tokens
    # Until the first eviction (after position 64 is computed) the three runs agree.
    unaffected = budget_tokens + 2 - len(prompt)
    assert seqs["lru"].output_token_ids[:unaffected] == seqs["sink"].output_token_ids[:unaffected]
    assert seqs["lru"].output_token_ids[:unaffected] == seqs["h2o"].output_token_ids[:unaffected]
    # Each evicted at least (prompt + 199 computed tokens) / 16 - budget blocks.
    assert engine.kv.eviction.num_evicted_blocks >= 3 * (
        (len(prompt) + num_tokens - 1) // BLOCK - budget
    )
    assert_all_released(engine.kv)
