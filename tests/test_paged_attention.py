"""Attention over the paged KV cache against a plain per-sequence, per-query reference in
float64; cache layout and group specs; device and dtype selection."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Gemma3TextConfig, Gemma4TextConfig

from engine.backends.custom import CustomBackend
from engine.backends.hf import HFBackend
from engine.device import parse_dtype, resolve_device, resolve_dtype
from engine.kv.block_tables import BlockCopy
from engine.model import attention_chunks, paged_attention
from engine.model.architecture import architecture_from_config
from engine.model.batch import ForwardBatch, GroupAttention
from engine.model.kv_cache import PagedKVCache, cache_group_specs
from engine.model.paged_attention import PagedAttentionStep
from engine.runner import ModelRunner
from tests.paged_driver import PagedDriver, hf_model

CPU = torch.device("cpu")
WINDOW = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def tiny_arch():
    config = Gemma3TextConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )
    return architecture_from_config(config)


def group_attention(slot_mapping, keys, width):
    """keys: per sequence a list of (slot, position); rows padded to `width`."""
    rows = [row + [(0, -1)] * (width - len(row)) for row in keys]
    valid = [[True] * len(row) + [False] * (width - len(row)) for row in keys]
    return GroupAttention(
        slot_mapping=torch.tensor(slot_mapping),
        key_slots=torch.tensor([[s for s, _ in row] for row in rows]),
        key_positions=torch.tensor([[p for _, p in row] for row in rows]),
        key_valid=torch.tensor(valid),
    )


def mixed_batch(collect_attention=False):
    """Four sequences in one step: two decodes and two prefill chunks with cached keys before
    them. Keys sit in scattered slots, listed out of position order, some slots unused (-1)."""
    keys0 = [(100 + 7 * p, p) for p in (3, 0, 9, 5, 1, 8, 2, 7, 4, 6)]  # decode at position 9
    keys1 = [(40 + 3 * p, p) for p in (4, 0, 1, 2, 3, 5, 6, 7)]  # chunk 5..7 after 5 cached keys
    keys2 = [(11, 0), (90, 2), (13, 1)]  # decode at position 2
    keys3 = [(70 + p, p) for p in range(4)]  # a fresh prefill of 0..3
    query_start = [0, 1, 4, 5, 9]
    positions = [9, 5, 6, 7, 2, 0, 1, 2, 3]
    # Sequence 0's new token is not stored (-1): attention reads whatever slot 163 holds.
    slots = [-1, 55, 58, 61, 90, 70, 71, 72, 73]
    group = group_attention(slots, [keys0, keys1, keys2, keys3], width=10)
    return ForwardBatch(
        input_ids=torch.zeros(9, dtype=torch.long),
        positions=torch.tensor(positions),
        query_start=query_start,
        groups={"full": group, "sliding": group},
        logits_indices=torch.tensor([0, 3, 4, 8]),
        collect_attention=collect_attention,
    )


def random_cache(layer, seed):
    """The tiny model's cache with `layer`'s pools random; the generator continues the draws."""
    arch = tiny_arch()
    cache = PagedKVCache(arch, num_blocks=50, block_size=4, device=CPU, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    for pool in (cache.keys[layer], cache.values[layer]):
        pool.copy_(torch.randn(pool.shape, generator=generator))
    return arch, cache, generator


def reference(query, key_pool, value_pool, batch, group, window, scaling, softcap):
    """Per sequence and query: softmax over the visible keys, in float64."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    masses = []
    groups = HEADS // KV_HEADS
    for i in range(batch.num_seqs):
        valid = group.key_valid[i]
        slots, kpos = group.key_slots[i][valid], group.key_positions[i][valid]
        keys = key_pool[slots].double().repeat_interleave(groups, dim=1)  # [K, H, D]
        values = value_pool[slots].double().repeat_interleave(groups, dim=1)
        mass = torch.zeros(len(slots), dtype=torch.float64)
        for row in range(batch.query_start[i], batch.query_start[i + 1]):
            qpos = int(batch.positions[row])
            visible = kpos <= qpos
            if window is not None:
                visible &= qpos - kpos < window
            scores = torch.einsum("hd,khd->hk", query[row].double(), keys) * scaling
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            probs = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1)
            out[row] = torch.einsum("hk,khd->hd", probs, values)
            mass += probs.sum(0)
        masses.append(mass)
    return out, masses


@pytest.mark.parametrize("group_name, layer", [("sliding", 0), ("full", 1)])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("query_slices", ["whole", "one row each"])
def test_mixed_batch_matches_reference(group_name, layer, softcap, query_slices, monkeypatch):
    if query_slices == "one row each":
        monkeypatch.setattr(attention_chunks, "MAX_SCORES_PER_SLICE", 1)
    arch, cache, generator = random_cache(layer, seed=0)
    batch = mixed_batch(collect_attention=True)
    window = arch.window_of_group(group_name)
    step = PagedAttentionStep(batch, cache, {"full": None, "sliding": WINDOW}, CPU, torch.float32)
    new_keys = torch.randn(9, KV_HEADS, HEAD_DIM, generator=generator)
    new_values = torch.randn(9, KV_HEADS, HEAD_DIM, generator=generator)
    step.write(layer, new_keys, new_values)
    query = torch.randn(9, HEADS, HEAD_DIM, generator=generator)
    out = step.attend(layer, query, scaling=0.3, softcap=softcap)

    group = batch.groups[group_name]
    written = group.slot_mapping >= 0
    assert torch.equal(cache.keys[layer][group.slot_mapping[written]], new_keys[written])
    assert not torch.equal(cache.keys[layer][163], new_keys[0])
    expected, masses = reference(
        query, cache.keys[layer], cache.values[layer], batch, group, window, 0.3, softcap
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    if group_name == "full":
        for got, want, length in zip(step.attention_mass(), masses, (10, 8, 3, 4), strict=True):
            assert got.shape == (length,)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:  # collected for the full group's keys only: a sliding layer adds nothing to them
        full = batch.groups["full"]
        for got, valid in zip(step.attention_mass(), full.key_valid, strict=True):
            assert torch.equal(got, torch.zeros(int(valid.sum())))


@pytest.mark.parametrize("group_name, layer", [("sliding", 0), ("full", 1)])
@pytest.mark.parametrize("collect_attention", [False, True])
def test_fused_attention_matches_reference(group_name, layer, collect_attention, monkeypatch):
    """fused=True (every mode but NUMERICS=exact): scaled_dot_product_attention over the same
    mixed batch, to float32 rounding of the float64 reference. A step that collects attention
    mass (h2o) keeps the explicit softmax, and its mass is still right."""
    arch, cache, generator = random_cache(layer, seed=1)
    batch = mixed_batch(collect_attention=collect_attention)
    if not collect_attention:  # the explicit path must not run at all
        monkeypatch.setattr(paged_attention, "attend_chunk", None)
    windows = {"full": None, "sliding": WINDOW}
    step = PagedAttentionStep(batch, cache, windows, CPU, torch.float32, fused=True)
    query = torch.randn(9, HEADS, HEAD_DIM, generator=generator)
    out = step.attend(layer, query, scaling=0.3)
    group = batch.groups[group_name]
    window = arch.window_of_group(group_name)
    expected, masses = reference(
        query, cache.keys[layer], cache.values[layer], batch, group, window, 0.3, None
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    if collect_attention and group_name == "full":
        for got, want in zip(step.attention_mass(), masses, strict=True):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cached, shuffled, blocks", [(0, False, 12), (5, False, 12), (5, True, 0)])
def test_fused_prefill_past_the_window_attends_in_query_blocks(cached, shuffled, blocks):
    """A prompt chunk longer than the sliding window (12 queries, window 4, after `cached`
    earlier keys) attends in blocks of query rows over the key columns each block can see.
    With its key columns out of position order each block would span nearly all of them, so
    the chunk stays one call. Either way to float32 rounding of the float64 reference."""
    layer = 0  # sliding
    _, cache, generator = random_cache(layer, seed=3)
    total = cached + 12
    positions = torch.randperm(total, generator=generator).tolist() if shuffled else range(total)
    keys = [(100 + 2 * p, p) for p in positions]
    group = group_attention([100 + 2 * p for p in range(cached, total)], [keys], width=total)
    batch = ForwardBatch(
        input_ids=torch.zeros(12, dtype=torch.long),
        positions=torch.arange(cached, total),
        query_start=[0, 12],
        groups={"full": group, "sliding": group},
        logits_indices=torch.tensor([11]),
    )
    windows = {"full": None, "sliding": WINDOW}
    step = PagedAttentionStep(batch, cache, windows, CPU, torch.float32, fused=True)
    (chunk,) = step.plans["sliding"].chunks
    assert len(chunk.query_blocks) == blocks  # window 4 // WINDOW_BLOCKS: a row per block
    query = torch.randn(12, HEADS, HEAD_DIM, generator=generator)
    out = step.attend(layer, query, scaling=0.3)
    expected, _ = reference(
        query, cache.keys[layer], cache.values[layer], batch, group, WINDOW, 0.3, None
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_name, layer", [("sliding", 0), ("full", 1)])
def test_fused_fresh_prompt_reads_its_own_keys(group_name, layer, monkeypatch):
    """The fresh prefill of positions 0..3 (the batch's last sequence) attends causally to
    the keys this step wrote, without gathering them back; every other chunk reads the pools.
    All to float32 rounding of the float64 reference over the pools after the write."""
    arch, cache, generator = random_cache(layer, seed=2)
    batch = mixed_batch(collect_attention=False)
    windows = {"full": None, "sliding": WINDOW}
    step = PagedAttentionStep(batch, cache, windows, CPU, torch.float32, fused=True)
    flags = [chunk.causal_fresh for chunk in step.plans[group_name].chunks]
    assert flags == [False, False, True]  # the decodes, the cached-prefix chunk, the fresh one
    gathered = []
    real_gather = attention_chunks.gather_keys_values
    monkeypatch.setattr(
        attention_chunks,
        "gather_keys_values",
        lambda chunk, *pools: gathered.append(chunk.q_len) or real_gather(chunk, *pools),
    )
    new_keys = torch.randn(9, KV_HEADS, HEAD_DIM, generator=generator)
    new_values = torch.randn(9, KV_HEADS, HEAD_DIM, generator=generator)
    step.write(layer, new_keys, new_values)
    query = torch.randn(9, HEADS, HEAD_DIM, generator=generator)
    out = step.attend(layer, query, scaling=0.3)
    assert 4 not in gathered  # the fresh chunk's keys were never gathered
    group = batch.groups[group_name]
    window = arch.window_of_group(group_name)
    expected, _ = reference(
        query, cache.keys[layer], cache.values[layer], batch, group, window, 0.3, None
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_name, layer", [("sliding", 0), ("full", 1)])
@pytest.mark.parametrize("fused", [False, True])
def test_bfloat16_cache_under_float32_queries(group_name, layer, fused):
    """KV_CACHE_DTYPE=bfloat16 under float32 weights: new keys and values are rounded to
    bfloat16 as they are stored, and attention over them is the float64 reference on those
    rounded keys: to float32 rounding on the explicit path, which computes in the queries'
    float32, and to bfloat16 rounding of the queries and output on the fused one, which runs
    in the cache's dtype. The output is float32 either way."""
    arch = tiny_arch()
    cache = PagedKVCache(arch, num_blocks=50, block_size=4, device=CPU, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    for pool in (cache.keys[layer], cache.values[layer]):
        pool.copy_(torch.randn(pool.shape, generator=generator))
    batch = mixed_batch()
    windows = {"full": None, "sliding": WINDOW}
    step = PagedAttentionStep(batch, cache, windows, CPU, torch.float32, fused=fused)
    new_keys = torch.randn(9, KV_HEADS, HEAD_DIM, generator=generator)
    new_values = torch.randn(9, KV_HEADS, HEAD_DIM, generator=generator)
    step.write(layer, new_keys, new_values)
    group = batch.groups[group_name]
    written = group.slot_mapping >= 0
    stored = cache.keys[layer][group.slot_mapping[written]]
    assert stored.dtype == torch.bfloat16 and torch.equal(stored, new_keys[written].bfloat16())
    query = torch.randn(9, HEADS, HEAD_DIM, generator=generator)
    out = step.attend(layer, query, scaling=0.3)
    assert out.dtype == torch.float32
    window = arch.window_of_group(group_name)
    expected, _ = reference(
        query, cache.keys[layer], cache.values[layer], batch, group, window, 0.3, None
    )
    tolerance = 3e-2 if fused else 1e-5
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    if fused:  # rounded, not the float32 result
        assert (out.double() - expected).abs().max() > 1e-5


def test_sliding_window_edge_is_exclusive():
    """Key at qpos - (window - 1) is visible, key at qpos - window is not (as transformers)."""
    arch = tiny_arch()
    cache = PagedKVCache(arch, num_blocks=4, block_size=4, device=CPU, dtype=torch.float32)
    cache.keys[0].normal_()
    qpos = 6
    keys = [[(p, p) for p in range(qpos + 1)]]
    group = group_attention([qpos], keys, width=qpos + 1)
    batch = ForwardBatch(
        input_ids=torch.zeros(1, dtype=torch.long),
        positions=torch.tensor([qpos]),
        query_start=[0, 1],
        groups={"sliding": group, "full": group},
        logits_indices=torch.tensor([0]),
        collect_attention=True,
    )
    step = PagedAttentionStep(batch, cache, {"sliding": WINDOW, "full": None}, CPU, torch.float32)
    step.write(0, torch.randn(1, KV_HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM))
    cache.values[0].zero_()
    cache.values[0][: qpos + 1, :, 0] = torch.arange(qpos + 1, dtype=torch.float32)[:, None]
    # With every score equal, the output is the mean of the visible values' first coordinate.
    query = torch.zeros(1, HEADS, HEAD_DIM)
    out = step.attend(0, query, scaling=1.0)
    visible = [p for p in range(qpos + 1) if qpos - p < WINDOW]
    assert visible == [3, 4, 5, 6]
    assert torch.allclose(out[0, :, 0], torch.tensor(sum(visible) / len(visible)))


def test_attention_mass_from_the_backend_counts_every_full_layer_and_head():
    config = Gemma3TextConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=3,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
    )
    backend = CustomBackend(config, hf_model(config, seed=0).state_dict(), CPU, torch.float32, 64)
    driver = PagedDriver(backend, shuffle_blocks=1)
    driver.step({0: [1, 2, 3, 4, 5], 1: [6, 7]})
    _, out = driver.step({0: [8], 1: [9, 10, 11]}, collect_attention=True)
    mass0, mass1 = (keyed.mass for keyed in out.attention_mass)
    assert mass0.shape == (6,) and mass1.shape == (5,)
    full_layers, heads = 2, 2
    torch.testing.assert_close(mass0.sum(), torch.tensor(full_layers * heads * 1.0))
    torch.testing.assert_close(mass1.sum(), torch.tensor(full_layers * heads * 3.0))
    assert torch.all(mass1[:2] > 0)  # every query sees the cached keys of full layers


def test_cache_group_specs_and_pools():
    config = Gemma4TextConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=1,
        hidden_size_per_layer_input=0,
        sliding_window=7,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
            "full_attention",
        ],
    )
    arch = architecture_from_config(config)
    full, sliding = cache_group_specs(arch, torch.bfloat16)
    assert (full.name, full.layer_ids, full.sliding_window, full.bytes_per_token) == (
        "full",
        (1, 3),
        None,
        128,
    )
    assert (sliding.name, sliding.layer_ids, sliding.sliding_window, sliding.bytes_per_token) == (
        "sliding",
        (0, 2),
        7,
        128,
    )
    cache = PagedKVCache(arch, num_blocks=3, block_size=5, device=CPU, dtype=torch.bfloat16)
    assert sorted(cache.keys) == [0, 1, 2, 3]  # layer 4 reads layer 3's cache
    assert cache.keys[1].shape == (15, 1, 16) and cache.values[0].shape == (15, 2, 8)
    assert cache.keys[0].dtype == torch.bfloat16


def test_bfloat16_runs_and_stays_close_to_float32():
    config = Gemma3TextConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
    )
    weights = hf_model(config, seed=0).state_dict()
    tokens = {0: [1, 5, 7, 9, 2, 3], 1: [4, 4]}
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        result, _ = PagedDriver(CustomBackend(config, weights, CPU, dtype, 64)).step(tokens)
        logits[dtype] = result
    for seq in tokens:
        assert logits[torch.bfloat16][seq].dtype == torch.float32
        torch.testing.assert_close(
            logits[torch.bfloat16][seq], logits[torch.float32][seq], atol=0.1, rtol=0.05
        )


def test_device_and_dtype_selection():
    assert resolve_device("cpu") == CPU
    assert resolve_device(None).type in ("cuda", "mps", "cpu")
    with pytest.raises(ValueError):
        resolve_device("tpu")
    assert resolve_dtype(None, CPU) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", CPU) == torch.float16
    assert parse_dtype("BF16") == torch.bfloat16 and parse_dtype("fp32") == torch.float32
    with pytest.raises(ValueError, match="DTYPE"):
        parse_dtype("int8")


def test_copy_blocks_applies_copies_in_order_to_one_group():
    config = Gemma3TextConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
    )
    backend = CustomBackend(config, hf_model(config, seed=0).state_dict(), CPU, torch.float32, 64)
    runner = ModelRunner(backend, num_blocks=4, block_size=2)
    cache = runner.kv_cache
    for pool in [*cache.keys.values(), *cache.values.values()]:
        pool.normal_()
    before = {
        layer: (cache.keys[layer].clone(), cache.values[layer].clone()) for layer in cache.keys
    }
    runner.copy_blocks([BlockCopy("full", 1, 3), BlockCopy("full", 3, 0)])
    keys, values = cache.keys[1], cache.values[1]
    for pool, old in ((keys, before[1][0]), (values, before[1][1])):
        assert torch.equal(pool[6:8], old[2:4]) and torch.equal(pool[0:2], old[2:4])
        assert torch.equal(pool[2:6], old[2:6])
    assert torch.equal(cache.keys[0], before[0][0]) and torch.equal(cache.values[0], before[0][1])


@pytest.mark.parametrize("backend_class", [CustomBackend, HFBackend])
def test_a_step_without_wanted_logits(backend_class):
    config = Gemma3TextConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        layer_types=["full_attention"],
    )
    backend = backend_class(config, hf_model(config, seed=0).state_dict(), CPU, torch.float32, 64)
    runner = ModelRunner(backend, num_blocks=4, block_size=4)
    group = group_attention([0, 1, 2], [[(0, 0), (1, 1), (2, 2)]], width=3)
    batch = ForwardBatch(
        input_ids=torch.tensor([3, 4, 5]),
        positions=torch.tensor([0, 1, 2]),
        query_start=[0, 3],
        groups={"full": group},
        logits_indices=torch.tensor([], dtype=torch.long),
    )
    assert runner.forward(batch).logits.shape == (0, 40)
