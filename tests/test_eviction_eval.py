"""The KV-eviction eval (evals/eviction.py) at its small size on the embedded model, and the
attention mass H2O's scores are built from (engine/model/paged_attention.py).

The eval's claims are checked where they are exact: before a sequence's first eviction and at
a 100% budget every policy computes what the full cache computes, bit for bit; at the end each
evicting sequence holds exactly its budget. Where eviction has happened, the relations are the
measured ones, with their margins (e.g. lru at 12.5% has about 3x the perplexity of sink).
"""

from __future__ import annotations

import pytest
import torch

from engine.model.batch import ForwardBatch
from engine.model.kv_cache import PagedKVCache
from engine.model.paged_attention import H2O_MASS_GROUPS, PagedAttentionStep
from evals.eviction import TEXT_DIR, evaluate, markdown_table, read_segments
from tests.engine_harness import one_torch_thread  # noqa: F401  (a fixture)
from tests.test_paged_attention import HEAD_DIM, HEADS, group_attention, tiny_arch

CPU = torch.device("cpu")
CONTEXT, BLOCK = 256, 16
FRACTIONS = (0.125, 1.0)


@pytest.fixture(scope="module")
def result(embedded_model, one_torch_thread) -> dict:  # noqa: F811
    """The fast size: 256 tokens of GPL-3, budgets of 12.5% (2 blocks) and 100%."""
    if not (TEXT_DIR / "GPL-3").exists():
        pytest.skip(f"{TEXT_DIR}/GPL-3 is missing (Debian's base-files)")
    segments = read_segments(embedded_model, ["GPL-3"], CONTEXT)
    return evaluate(
        embedded_model, segments, FRACTIONS, block_size=BLOCK, timed_steps=2, progress=False
    )


def rows(result: dict, fraction: float | None) -> list[dict]:
    return [row for row in result["rows"] if row["budget_fraction"] == fraction]


@pytest.mark.slow
def test_a_full_budget_is_the_full_cache_bit_for_bit(result):
    (full,) = rows(result, None)
    assert full["variant"] == "full cache"
    assert full["held_blocks"] == {"full": 16, "sliding": 16}  # 255 tokens; window 512
    whole = rows(result, 1.0)
    assert [row["variant"] for row in whole] == ["lru", "sink", "h2o", "h2o+sliding"]
    for row in whole:
        assert row["nll"] == full["nll"]
        assert row["argmax"] == full["argmax"]
        assert row["agreement"] == 1.0 and row["perplexity_vs_full"] == 1.0
        assert row["held_blocks"] == full["held_blocks"] and row["kv_vs_full"] == 1.0


@pytest.mark.slow
def test_eviction_changes_logits_exactly_from_the_first_evicted_step(result):
    (full,) = rows(result, None)
    for row in rows(result, 0.125):
        assert row["budget_blocks"] == 2  # 32 tokens
        first = row["budget_blocks"] * BLOCK + 1  # position 32 is computed, then evicted
        (nll,), (reference,) = row["nll"], full["nll"]
        assert nll[:first] == reference[:first], row["variant"]
        assert nll[first] != reference[first], row["variant"]
        assert row["argmax"][0][:first] == full["argmax"][0][:first]


@pytest.mark.slow
def test_evicting_sequences_hold_exactly_their_budget(result):
    for row in rows(result, 0.125):
        assert row["held_blocks"] == {"full": 2, "sliding": 2}, row["variant"]
        assert row["kv_vs_full"] == 2 / 16


@pytest.mark.slow
def test_small_budgets_cost_perplexity_in_the_measured_order(result):
    (full,) = rows(result, None)
    small = {row["variant"]: row for row in rows(result, 0.125)}
    for row in small.values():
        assert 0.0 <= row["agreement"] < 1.0
        assert 0.0 <= row["agreement_second_half"] < 1.0
        assert row["perplexity"] > full["perplexity"]
        assert row["perplexity_vs_full"] == pytest.approx(row["perplexity"] / full["perplexity"])
    # Measured 89.8 (lru) against 28.2 (sink, h2o): dropping the attention sink costs most.
    assert small["lru"]["perplexity"] > 2 * small["sink"]["perplexity"]
    assert small["lru"]["perplexity"] > 2 * small["h2o"]["perplexity"]
    assert small["lru"]["agreement"] < small["sink"]["agreement"]


@pytest.mark.slow
def test_markdown_table_has_a_row_per_variant(result):
    table = markdown_table(result).splitlines()
    assert len(table) == 2 + len(result["rows"])
    assert table[2].startswith("| 100% (full cache) | full cache | ")


def test_sliding_layer_mass_lands_on_the_full_key_at_the_same_position():
    """One decode at position 5: the full group holds positions 0..5, the sliding group only
    3..5 (in other slots, listed in another order). Counting sliding layers adds each sliding
    key's mass to the full key of the same position; the default counts full layers only."""
    arch = tiny_arch()  # layer 0 sliding (window 4), layer 1 full
    cache = PagedKVCache(arch, num_blocks=50, block_size=4, device=CPU, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    for pool in (*cache.keys.values(), *cache.values.values()):
        pool.copy_(torch.randn(pool.shape, generator=generator))
    full_keys = [(20 + p, p) for p in (0, 1, 2, 3, 4, 5)]
    sliding_keys = [(45, 5), (33, 3), (37, 4)]
    batch = ForwardBatch(
        input_ids=torch.zeros(1, dtype=torch.long),
        positions=torch.tensor([5]),
        query_start=[0, 1],
        groups={
            "full": group_attention([25], [full_keys], width=6),
            "sliding": group_attention([45], [sliding_keys], width=3),
        },
        logits_indices=torch.tensor([0]),
        collect_attention=True,
    )
    step = PagedAttentionStep(
        batch, cache, {"full": None, "sliding": 4}, CPU, torch.float32, ("full", "sliding")
    )
    query = torch.randn(1, HEADS, HEAD_DIM, generator=generator)
    step.attend(0, query, scaling=0.3)
    step.attend(1, query, scaling=0.3)
    (full,) = step.attention_mass(("full",))
    (sliding,) = step.attention_mass(("sliding",))
    (both,) = step.attention_mass()
    assert H2O_MASS_GROUPS == ("full",)
    assert full.shape == sliding.shape == (6,)
    torch.testing.assert_close(full.sum(), torch.tensor(float(HEADS)))
    torch.testing.assert_close(sliding.sum(), torch.tensor(float(HEADS)))
    assert torch.all(sliding[:3] == 0) and torch.all(sliding[3:] > 0)  # positions 0..2 unseen
    torch.testing.assert_close(both, full + sliding)
    # The sliding layer's own per-key mass, reordered from its key order (5, 3, 4).
    own = step.masses["sliding"][0]
    torch.testing.assert_close(sliding[3:], torch.stack([own[1], own[2], own[0]]))
    # Without mass_groups the step collects the default groups only.
    default = PagedAttentionStep(batch, cache, {"full": None, "sliding": 4}, CPU, torch.float32)
    assert set(default.masses) == {"full"}
    with pytest.raises(ValueError):
        default.attention_mass(("sliding",))
