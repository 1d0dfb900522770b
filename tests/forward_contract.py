"""Forward-pass checks every tiny Gemma config must pass; test_forward_gemma3/4 import them,
so pytest runs them once per module against that module's `setup` fixture
(name, config, transformers reference model, weights)."""

from __future__ import annotations

import pytest
import torch

from engine.backends.custom import CustomBackend
from engine.backends.hf import HFBackend
from tests.paged_driver import PagedDriver, engine_greedy

CPU = torch.device("cpu")


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_scattered_blocks_give_the_same_logits(setup):
    _, config, _, weights = setup
    backend = CustomBackend(config, weights, CPU, torch.float32, 256)
    prompts = {0: prompt(11, 20, config.vocab_size), 1: prompt(6, 21, config.vocab_size)}
    contiguous = engine_greedy(PagedDriver(backend, num_blocks=64, block_size=2), prompts, 12)
    scattered = engine_greedy(
        PagedDriver(backend, num_blocks=64, block_size=2, shuffle_blocks=7), prompts, 12
    )
    for seq in prompts:
        assert all(torch.equal(a, b) for a, b in zip(contiguous[seq], scattered[seq], strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_backend_matches_custom_on_a_mixed_batch(setup, dtype):
    _, config, _, weights = setup
    prompts = {0: prompt(7, 30, config.vocab_size), 1: prompt(3, 31, config.vocab_size)}
    joins = {2: {2: prompt(10, 32, config.vocab_size)}}
    results = [
        engine_greedy(
            PagedDriver(backend_class(config, weights, CPU, dtype, 256), shuffle_blocks=8),
            prompts,
            8,
            joins=joins,
        )
        for backend_class in (CustomBackend, HFBackend)
    ]
    for seq in (0, 1, 2):
        assert all(torch.equal(a, b) for a, b in zip(results[0][seq], results[1][seq], strict=True))
