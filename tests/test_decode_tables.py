"""A pure decode step's addressing built in one pass (engine.model.decode_tables) against the
general GroupPlan path it stands in for: the same write slots, key slots and mask for every
storing layer, on real batches from the KV manager: pools per group and shared pages (blocks on
several pages, layers sharing a lane), sliding windows dropping blocks, prefix-cached and
copied-on-write blocks, float32 and bfloat16 caches."""

from __future__ import annotations

import pytest
import torch

from engine.backends.custom import CustomBackend
from engine.kv.layout import SharedPages
from engine.model import cpu_ops, paged_attention
from engine.model.paged_attention import PagedAttentionStep
from tests import test_forward_gemma3 as gemma3
from tests import test_forward_gemma4 as gemma4
from tests.forward_contract import prompt
from tests.paged_driver import hf_model
from tests.test_shared_pages import greedy_through_the_manager

CPU = torch.device("cpu")


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler to build the fused kernels")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "make_config, layout",
    [
        (gemma3.gqa_config, 64),  # a pool per group
        (gemma3.gqa_config, SharedPages(40, 2, 32)),  # sliding blocks on 2 pages
        (gemma3.gqa_config, SharedPages(70, 1, 32)),  # every block on 2 or 3 pages
        (gemma4.mha_config, SharedPages(24, 1, 32)),  # 2 sliding layers share a lane
    ],
)
def test_decode_tables_match_the_group_plans(make_config, layout, kv_dtype, monkeypatch):
    steps = []

    class CheckedStep(PagedAttentionStep):
        def __init__(self, batch, cache, windows, device, dtype, **kwargs):
            super().__init__(batch, cache, windows, device, dtype, **kwargs)
            if self._decode is None:
                assert any(n > 1 for n in batch.query_lens)  # only prefill steps go without
                return
            for layer in cache.keys:
                keys, values, write_slots, key_slots, mask = self.decode_addressing(layer)
                plan = self._plan_of(layer)  # the general path: GroupPlan, relocated
                (chunk,) = plan.chunks
                assert plan.write_rows is None and chunk.q_len == 1
                assert keys is cache.keys[layer] and values is cache.values[layer]
                assert torch.equal(write_slots, plan.write_slots)
                assert torch.equal(key_slots, chunk.key_slots)
                # The kernel reads float32: the tables hold GroupPlan's mask values as such.
                assert mask.dtype == torch.float32 and chunk.mask.dtype == dtype
                assert mask.shape == chunk.mask.shape and torch.equal(mask, chunk.mask.float())
            steps.append(batch.num_seqs)

    monkeypatch.setattr(paged_attention, "PagedAttentionStep", CheckedStep)
    monkeypatch.setattr("engine.runner.PagedAttentionStep", CheckedStep)
    config = make_config()
    weights = hf_model(config, seed=7).state_dict()
    backend = CustomBackend(config, weights, CPU, torch.float32, 256, kernel="packed")
    first = prompt(10, 1, config.vocab_size)
    prompts = {0: first, 1: first[:8] + prompt(5, 2, config.vocab_size)}
    greedy_through_the_manager(backend, layout, prompts, {3: {2: first}}, 12, kv_dtype=kv_dtype)
    # 16 steps: the first prefills two prompts; the third prompt (step 3) is the first one,
    # cached but for its last token, which it recomputes in a one-token row (copying its
    # partial block on write); the first two finish after step 12, the third after step 15.
    assert steps == [2, 2] + [3] * 10 + [1] * 3
